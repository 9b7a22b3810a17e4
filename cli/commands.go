package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"

	"github.com/onceflow/onceflow/config"
)

// env is what a subcommand gets from the process: output streams and the environment.
type env struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	// app is the program's name and workflows (Run's App; Name set).
	app App
}

// command is one subcommand; each lives in its own file.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, e *env, args []string) error
}

// commands lists the built-in subcommands, in the order `help` shows them (version
// last, after App.Commands).
func commands() []command {
	return []command{
		{"migrate", "create or upgrade the PostgreSQL schema (safe to run twice and concurrently)", runMigrate},
		{"serve", "run the HTTP API", runServe},
		{"work", "run a Redis Streams worker (run several, on several machines)", runWork},
		{"dlq", "list, replay or purge dead-lettered jobs: dlq list | replay ID|--all | purge ID|--all", runDLQ},
		{"run", "run serve, work and relay in one process", runRun},
		{"audit", "check the pipeline's invariants on live data and print counts (exit 4 on a violation)", runAudit},
		{"relay", "run the outbox relay (run several: they never send the same row at once)", runRelay},
		{"outbox", "list [--failed] [--json] | retry ID|--all: inspect outbox rows, reset exhausted ones", runOutbox},
		{"approvals", "list [--tenant T|--all] [--json] | approve|reject JOB KEY [--note N]: tool calls waiting for an operator's decision", runApprovals},
		{"indoubt", "list [--json] | resolve JOB KEY (--happened --result R | --not-happened): jobs whose tool call's outcome nobody knows", runInDoubt},
		{"shadow", "report [--step S] [--since D] [--json]: how shadow candidates' answers compare with production's", runShadow},
		{"batches", "list [--json] | cancel ID: the batch lane's waiting requests and batches; cancel a batch at the provider", runBatches},
		{"eval", "--step S --candidate MODEL [--since D] [--json]: ask a candidate the step's recorded production inputs, and report", runEval},
		{"tenants", "set TENANT --tokens-per-day N | delete TENANT | list [--json]: tenants' daily model token budgets and use today", runTenants},
		{"gateway", "an OpenAI-compatible proxy adding Idempotency-Key semantics to any upstream (ONCEFLOW_GATEWAY_ADDR)", runGateway},
		{"probe", "does a provider honour Idempotency-Key? one key twice: honoured (0), ignored (3), inconclusive (1)", runProbe},
		{"version", "print the version", runVersion},
	}
}

// run dispatches args[0] to its subcommand: a built-in one, else one of
// App.Commands.
func run(ctx context.Context, args []string, e *env) error {
	if err := checkCommands(e.app.Commands); err != nil {
		return err
	}
	if err := checkProviders(e.app.Providers); err != nil {
		return err
	}
	if len(args) == 0 || slices.Contains([]string{"help", "-h", "-help", "--help"}, args[0]) {
		printCommands(e.stdout, e.app)
		if len(args) == 0 {
			return usageErrorf("missing command")
		}
		return nil
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return c.run(ctx, e, args[1:])
		}
	}
	for _, c := range e.app.Commands {
		if c.Name == args[0] {
			return c.Run(ctx, e.public(), args[1:])
		}
	}
	return usageErrorf("unknown command %q; run `%s help`", args[0], e.app.Name)
}

// checkCommands reports an App.Commands entry that cannot run: no name or Run, or the
// name of a built-in command or of another entry.
func checkCommands(cs []Command) error {
	names := map[string]bool{}
	for _, c := range commands() {
		names[c.name] = true
	}
	for i, c := range cs {
		switch {
		case c.Name == "" || c.Run == nil || strings.HasPrefix(c.Name, "-"):
			return usageErrorf("cli.App.Commands[%d]: a command needs a Name (not a flag) and a Run", i)
		case names[c.Name]:
			return usageErrorf("cli.App.Commands[%d]: the command %q is already defined", i, c.Name)
		}
		names[c.Name] = true
	}
	return nil
}

// printCommands is `help`: every command of app, the built-in ones, then app's, then
// version.
func printCommands(w io.Writer, app App) {
	fmt.Fprintf(w, "usage: %s COMMAND [flags]\n\ncommands:\n", app.Name)
	var version command
	for _, c := range commands() {
		if c.name == "version" {
			version = c
			continue
		}
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.summary)
	}
	for _, c := range app.Commands {
		fmt.Fprintf(w, "  %-12s %s\n", c.Name, c.Summary)
	}
	fmt.Fprintf(w, "  %-12s %s\n", version.name, version.summary)
	fmt.Fprintf(w, "\nRun `%s COMMAND -h` for a command's flags. Every setting is also an environment variable (docs/configuration.md).\n", app.Name)
}

// isHelp reports whether arg asks for help: -h, -help or --help.
func isHelp(arg string) bool { return arg == "-h" || arg == "-help" || arg == "--help" }

// checkSubcommand checks that args, those of the command name with subcommands
// (usage lists them), start with a subcommand: -h prints the command's usage
// (flag.ErrHelp), none is a usage error.
func checkSubcommand(e *env, name, usage string, args []string) error {
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		return nil
	}
	if len(args) > 0 && isHelp(args[0]) {
		printParentUsage(e, name, usage)
		return flag.ErrHelp
	}
	return usageErrorf("%s: missing subcommand; usage: %s %s %s", name, e.app.Name, name, strings.SplitN(usage, "\n", 2)[0])
}

// printParentUsage is the -h of the command name, which has subcommands (dlq, outbox...):
// its usage, which lists them, then how to see a subcommand's flags.
func printParentUsage(e *env, name, usage string) {
	fmt.Fprintf(e.stderr, "usage: %s %s %s\n\nRun `%s %s SUBCOMMAND -h` for a subcommand's flags.\n", e.app.Name, name, usage, e.app.Name, name)
}

// usageError marks a usage or configuration mistake: exit status 2.
type usageError struct{ err error }

func (u *usageError) Error() string { return u.err.Error() }
func (u *usageError) Unwrap() error { return u.err }

func usageErrorf(format string, args ...any) error {
	return &usageError{fmt.Errorf(format, args...)}
}

// isUsage reports whether err is a usage or configuration error.
func isUsage(err error) bool {
	var u *usageError
	var c *config.Error
	return errors.As(err, &u) || errors.As(err, &c)
}

// exitError carries a command-specific exit status (audit 4, probe 3).
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// public is what e gives a command: the Env of App.Commands' commands.
func (e *env) public() Env {
	return Env{Name: e.app.Name, Stdout: e.stdout, Stderr: e.stderr, Getenv: e.getenv, check: e.app.checkProvider}
}

// flags returns the FlagSet of a built-in subcommand (Env.Flags): -h lists its own
// flags and the settings of groups, the settings it reads.
func flags(e *env, name, usage string, groups ...config.Group) *flag.FlagSet {
	return e.public().Flags(name, usage, groups...)
}

// load parses args and resolves the configuration (Env.Load); the loader must have
// been registered on fs.
func load(e *env, fs *flag.FlagSet, l *config.Loader, args []string) (*config.Config, *slog.Logger, error) {
	return e.public().Load(fs, l, args)
}

// settings resolves the configuration l registered without parsing flags (the
// commands that parse their own, interspersed with arguments).
func settings(e *env, l *config.Loader) (*config.Config, error) {
	return e.public().settings(l)
}
