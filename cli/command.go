package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"

	"github.com/onceflow/onceflow/cli/internal/tracing"
	"github.com/onceflow/onceflow/config"
)

// Command is a subcommand a program adds to the built-in ones (App.Commands): the
// onceflow binary adds `fake-llm` (package cli/fakellm) and `webhook-sink` (package
// cli/webhooksink) this way, so that a program of one's own links them only when it
// lists them.
type Command struct {
	// Name runs it: `PROGRAM NAME [flags]`. It must not be a built-in command's name
	// nor another Command's (Run answers exit 2).
	Name string
	// Summary is its line in `PROGRAM help`.
	Summary string
	// Run runs the command with the arguments that follow its name, until it is done
	// or ctx is cancelled (SIGINT, SIGTERM). Its error is printed and mapped to the
	// exit status as a built-in command's (ExitCode): flag.ErrHelp is 0, an error of
	// UsageErrorf or a *config.Error 2.
	Run func(ctx context.Context, e Env, args []string) error
}

// Env is what a command gets from the process: the program's name, its output streams
// and its environment, and the command's way to the ONCEFLOW_* settings (Flags, Load).
type Env struct {
	// Name is the program's name (App.Name): "onceflow".
	Name string
	// Stdout and Stderr are the process's output streams; the logs go to Stderr.
	Stdout, Stderr io.Writer
	// Getenv reads the environment.
	Getenv func(string) string

	// check vets a configuration beyond its syntax: that ONCEFLOW_LLM names a provider
	// the program links (App.Providers).
	check func(*config.Config) error
}

// UsageErrorf returns a usage or configuration error, which ExitCode maps to 2.
func UsageErrorf(format string, args ...any) error {
	return &usageError{fmt.Errorf(format, args...)}
}

// Flags returns the flag set of the command name (a built-in's, or "fake-llm"): its
// parse errors are returned, not fatal, and its -h prints to Stderr `usage: PROGRAM
// NAME USAGE`, the flags defined on it, then, group by group, the flags of the
// settings in groups: the settings the command reads, each with its environment
// variable and default. Register the settings on it (config.Register) to accept their
// flags: the flag of every setting is accepted and checked, also of those the command
// does not read and -h does not list, as every command always has.
func (e Env) Flags(name, usage string, groups ...config.Group) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(e.Stderr)
	fs.Usage = func() { printFlagsUsage(fs, cmp.Or(e.Name, "onceflow"), name, usage, groups) }
	return fs
}

// printFlagsUsage is the -h of the command name: its usage line, its own flags and the
// flags of the settings of groups.
func printFlagsUsage(fs *flag.FlagSet, program, name, usage string, groups []config.Group) {
	w := fs.Output()
	fmt.Fprintln(w, strings.TrimRight(fmt.Sprintf("usage: %s %s %s", program, name, usage), " "))
	var own []string
	settings := false
	fs.VisitAll(func(f *flag.Flag) {
		if config.IsFlag(f.Name) {
			settings = true
		} else {
			own = append(own, f.Name)
		}
	})
	if len(own) > 0 {
		fmt.Fprintf(w, "\nflags:\n")
		printFlags(w, fs, own)
	}
	if !settings {
		return
	}
	listed := false
	for _, g := range groups {
		names := slices.DeleteFunc(g.Flags(), func(n string) bool { return fs.Lookup(n) == nil })
		if len(names) == 0 {
			continue
		}
		if !listed {
			fmt.Fprintf(w, "\nsettings %s reads (each flag is also the environment variable named; a flag wins):\n", name)
			listed = true
		}
		fmt.Fprintf(w, "\n%s:\n", g)
		for _, n := range names {
			f := fs.Lookup(n)
			typ, usage := flag.UnquoteUsage(f)
			fmt.Fprintf(w, "  -%s %s\n    \t%s\n", f.Name, typ, usage)
		}
	}
	fmt.Fprintf(w, "\nThe other settings (docs/configuration.md) are accepted as flags too, and checked, though %s does not use them.\n", name)
}

// printFlags prints the flags of fs named, as flag.PrintDefaults does (sorted, with
// their defaults).
func printFlags(w io.Writer, fs *flag.FlagSet, names []string) {
	sub := flag.NewFlagSet(fs.Name(), flag.ContinueOnError)
	sub.SetOutput(w)
	for _, n := range names {
		f := fs.Lookup(n)
		sub.Var(f.Value, f.Name, f.Usage)
		sub.Lookup(n).DefValue = f.DefValue // the default, not what a flag before -h set
	}
	sub.PrintDefaults()
}

// Parse parses args with fs (from Flags): flag.ErrHelp for -h, a usage error (exit 2)
// for a bad flag. Load parses too; Parse is for a command that reads no setting.
func (e Env) Parse(fs *flag.FlagSet, args []string) error { return parse(fs, args) }

// Load parses args with fs (from Flags) and resolves the settings l registered on it
// (config.Register): a flag wins over its variable, which wins over the default. It
// also checks the OTEL_* variables and that ONCEFLOW_LLM names a provider the program
// links. It returns the settings and a logger writing to Stderr in ONCEFLOW_LOG_FORMAT;
// flag.ErrHelp for -h; a usage error for a bad flag and a *config.Error for a bad
// setting (both exit 2).
func (e Env) Load(fs *flag.FlagSet, l *config.Loader, args []string) (*config.Config, *slog.Logger, error) {
	if err := parse(fs, args); err != nil {
		return nil, nil, err
	}
	cfg, err := e.settings(l)
	if err != nil {
		return nil, nil, err
	}
	if _, err := tracing.FromEnv(e.Getenv); err != nil {
		return nil, nil, err // the OTEL_* variables are settings too: a bad one exits 2
	}
	return cfg, newLogger(e.Stderr, cfg.LogFormat), nil
}

// settings resolves the settings l registered, and checks them against the program
// (its providers).
func (e Env) settings(l *config.Loader) (*config.Config, error) {
	cfg, err := l.Load(e.Getenv)
	if err != nil {
		return nil, err
	}
	if e.check != nil {
		if err := e.check(cfg); err != nil {
			return nil, err
		}
	}
	return cfg, nil
}

// parse parses args into fs, mapping errors to usage errors; -h returns flag.ErrHelp.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return &usageError{err}
	}
	return nil
}

// newLogger returns the process logger: JSON (default) or text on w.
func newLogger(w io.Writer, format string) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if strings.EqualFold(format, "text") {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}
