// Package cli is the onceflow command as a library: the subcommands that run the API,
// the workers, the outbox relay and the operator tools (migrate, dlq, outbox, audit,
// probe, gateway), hosting the workflows of the program that embeds it (App, Main,
// Run). It knows no workflow of its own: cmd/onceflow is Main with the summaries
// service's workflow and audit (package service), and a program of one's own
// is Main with its workflows, on the same path. Run `onceflow help` for the list.
//
// A program links only the model providers and extra commands it lists in its App
// (App.Providers, App.Commands): the onceflow binary lists openai and anthropic
// (packages cli/openaiprovider, cli/anthropicprovider) and fake-llm and webhook-sink
// (cli/fakellm, cli/webhooksink); the fake provider is built in.
//
// Each command's -h lists its own flags and the settings it reads, with their
// variables and defaults. Every command still accepts, and checks, the flag and the
// variable of every setting, so a script that passes one a command does not read keeps
// working, and a bad value anywhere stops any command (exit 2).
//
// Exit status: 0 success, 1 failure, 2 usage or configuration error; `audit` exits 4 when
// an invariant is violated and `probe` 3 when the provider ignores Idempotency-Key.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// exitCode maps an error to the documented exit status.
func exitCode(err error) int {
	var coded *exitError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &coded):
		return coded.code
	case isUsage(err):
		return 2
	default:
		return 1
	}
}

// signalContext returns a context cancelled by the first SIGINT or SIGTERM; a second
// signal exits the process at once with status 1.
func signalContext(stderr io.Writer) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case s := <-sigs:
			fmt.Fprintf(stderr, "onceflow: %v: shutting down (send it again to exit at once)\n", s)
			cancel()
		case <-ctx.Done():
			return
		}
		if s, ok := <-sigs; ok {
			fmt.Fprintf(stderr, "onceflow: %v again: exiting now\n", s)
			os.Exit(1)
		}
	}()
	return ctx, func() { signal.Stop(sigs); cancel() }
}
