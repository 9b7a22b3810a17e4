package cli_test

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/fakellm"
	"github.com/onceflow/onceflow/cli/webhooksink"
	"github.com/onceflow/onceflow/internal/testenv"
)

// helpApp is the App the -h tests run: the onceflow binary's commands.
var helpApp = cli.App{Commands: []cli.Command{fakellm.Command(), webhooksink.Command()}}

// help runs `args... -h` and returns what it printed on stderr; -h exits 0 and prints
// nothing on stdout.
func help(t *testing.T, args ...string) string {
	t.Helper()
	var out, errs bytes.Buffer
	err := cli.Run(context.Background(), helpApp, append(args, "-h"), &out, &errs, func(string) string { return "" })
	if code := cli.ExitCode(err); code != 0 {
		t.Fatalf("%s -h: exit %d (%v), want 0; stderr:\n%s", strings.Join(args, " "), code, err, errs.String())
	}
	if out.Len() > 0 {
		t.Errorf("%s -h printed on stdout: %q", strings.Join(args, " "), out.String())
	}
	return errs.String()
}

// listed reports whether a -h output lists --name as a flag line.
func listed(usage, name string) bool {
	return regexp.MustCompile(`(?m)^  -` + regexp.QuoteMeta(name) + `( |$)`).MatchString(usage)
}

// Each command's -h lists its own flags and the settings it reads, each with its
// variable, and none of the settings it does not read (the service's API keys, admin
// keys or database under fake-llm).
func TestHelpListsTheFlagsACommandReads(t *testing.T) {
	t.Parallel()
	cases := []struct {
		args       []string
		has, hasnt []string
	}{
		{[]string{"migrate"}, []string{"database-url", "log-format"},
			[]string{"redis-url", "api-keys", "claim-idle", "llm", "http-addr"}},
		{[]string{"serve"}, []string{"api-keys", "http-addr", "redis-url", "database-url", "admin-keys", "idempotency-timeout",
			"queue-partitions", "redis-wait-replicas", "http-read-timeout", "shutdown-timeout", "log-format"},
			[]string{"worker-concurrency", "claim-idle", "relay-interval", "gateway-addr", "llm", "openai-api-key", "metrics-addr", "fail-429", "sender"}},
		{[]string{"work"}, []string{"queue", "worker-concurrency", "claim-idle", "max-deliveries", "llm", "llm-model", "openai-api-key",
			"llm-rpm", "ledger-lease", "metrics-addr", "redis-url", "database-url"},
			[]string{"api-keys", "admin-keys", "http-addr", "relay-interval", "gateway-addr", "sender", "audit-max-age"}},
		{[]string{"relay"}, []string{"relay-interval", "relay-max-attempts", "outbox-retention", "sender", "webhook-url", "smtp-url",
			"metrics-addr", "redis-url", "database-url"},
			[]string{"api-keys", "llm", "worker-concurrency", "gateway-addr", "admin-keys"}},
		{[]string{"run"}, []string{"queue", "api-keys", "http-addr", "admin-keys", "worker-concurrency", "llm", "ledger-lease",
			"relay-interval", "sender", "redis-url", "database-url"},
			[]string{"gateway-addr", "metrics-addr", "audit-max-age"}},
		{[]string{"audit"}, []string{"json", "audit-max-age", "claim-idle", "max-run-time", "redis-url", "database-url"},
			[]string{"api-keys", "gateway-addr", "http-addr", "llm", "relay-interval"}},
		{[]string{"dlq", "list"}, []string{"queue", "all", "limit", "json", "redis-url", "prefix", "result-ttl", "queue-partitions"},
			[]string{"database-url", "api-keys", "llm"}},
		{[]string{"outbox", "list"}, []string{"failed", "topic", "limit", "json", "database-url"},
			[]string{"redis-url", "api-keys", "relay-interval"}},
		{[]string{"outbox", "retry"}, []string{"all", "database-url"}, []string{"redis-url", "api-keys"}},
		{[]string{"tenants", "set"}, []string{"tokens-per-day", "database-url"}, []string{"redis-url", "api-keys"}},
		{[]string{"tenants", "delete"}, []string{"database-url", "tenant-token-budget"}, []string{"redis-url", "api-keys"}},
		{[]string{"tenants", "list"}, []string{"json", "database-url", "redis-url", "tenant-token-budget", "llm-prices"},
			[]string{"api-keys", "worker-concurrency"}},
		{[]string{"approvals", "list"}, []string{"tenant", "all", "json", "limit", "database-url", "redis-url"},
			[]string{"api-keys", "llm", "worker-concurrency"}},
		{[]string{"approvals", "approve"}, []string{"tenant", "note", "by", "queue", "database-url", "redis-url", "prefix", "queue-partitions"},
			[]string{"api-keys", "llm", "worker-concurrency", "admin-keys"}},
		{[]string{"indoubt", "list"}, []string{"json", "limit", "database-url", "redis-url"}, []string{"api-keys", "llm"}},
		{[]string{"indoubt", "resolve"}, []string{"tenant", "happened", "not-happened", "result", "queue", "database-url", "redis-url", "queue-partitions"},
			[]string{"api-keys", "llm", "worker-concurrency"}},
		{[]string{"probe"}, []string{"base-url", "model", "api-key-env", "timeout", "json", "llm-base-url", "llm-model"},
			[]string{"database-url", "redis-url", "api-keys", "openai-api-key"}},
		{[]string{"gateway"}, []string{"gateway-addr", "gateway-timeout", "llm-base-url", "llm-model", "llm-rpm", "ledger-lease",
			"redis-url", "database-url", "http-read-timeout", "shutdown-timeout"},
			[]string{"api-keys", "http-addr", "admin-keys", "worker-concurrency", "openai-api-key", "sender"}},
		{[]string{"fake-llm"}, []string{"addr", "fail-429", "hang", "seed", "rpm", "http-read-timeout", "shutdown-timeout", "log-format"},
			[]string{"database-url", "redis-url", "api-keys", "admin-keys", "claim-idle", "llm", "llm-rpm", "gateway-addr"}},
		{[]string{"webhook-sink"}, []string{"addr", "fail-rate", "fail-status", "http-read-timeout", "log-format"},
			[]string{"database-url", "redis-url", "api-keys", "sender", "webhook-url"}},
		{[]string{"version"}, nil, []string{"database-url", "log-format"}},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			usage := help(t, tc.args...)
			if !strings.HasPrefix(usage, "usage: onceflow "+tc.args[0]) {
				t.Errorf("-h does not start with its usage line:\n%s", usage)
			}
			for _, f := range tc.has {
				if !listed(usage, f) {
					t.Errorf("-h does not list --%s:\n%s", f, usage)
				}
			}
			for _, f := range tc.hasnt {
				if listed(usage, f) {
					t.Errorf("-h lists --%s, which %s does not read:\n%s", f, tc.args[0], usage)
				}
			}
			// Every setting listed names its variable; no flag is listed twice.
			seen := map[string]bool{}
			lines := strings.Split(usage, "\n")
			for i, line := range lines {
				m := regexp.MustCompile(`^  -([a-z0-9-]+)`).FindStringSubmatch(line)
				if m == nil {
					continue
				}
				if seen[m[1]] {
					t.Errorf("--%s is listed twice", m[1])
				}
				seen[m[1]] = true
				if strings.Contains(usage, "settings "+tc.args[0]) && i+1 < len(lines) && strings.Contains(lines[i+1], "(env ") &&
					!regexp.MustCompile(`\(env [A-Z_]+(, default [^)]*)?\)`).MatchString(lines[i+1]) {
					t.Errorf("--%s does not show its variable and default: %q", m[1], lines[i+1])
				}
			}
		})
	}
}

// A usage error (an unknown flag) prints the same usage: the command's flags only.
func TestUsageErrorListsTheCommandsFlags(t *testing.T) {
	t.Parallel()
	var errs bytes.Buffer
	err := cli.Run(context.Background(), helpApp, []string{"fake-llm", "--no-such-flag"}, &bytes.Buffer{}, &errs,
		func(string) string { return "" })
	if code := cli.ExitCode(err); code != 2 {
		t.Fatalf("exit %d (%v), want 2", code, err)
	}
	usage := errs.String()
	if !strings.Contains(usage, "flag provided but not defined: -no-such-flag") || !listed(usage, "fail-429") ||
		listed(usage, "database-url") {
		t.Fatalf("the usage of a bad flag is not fake-llm's own:\n%s", usage)
	}
}

// The flags and variables of the settings still work: a listed one is read, one that
// -h no longer lists is still accepted (scripts pass them) and, like every variable,
// still checked.
func TestSettingsStillWorkAsFlagsAndVariables(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, env map[string]string, args ...string) (string, error) {
		t.Helper()
		var errs testenv.SyncBuffer
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() {
			done <- cli.Run(ctx, helpApp, args, &bytes.Buffer{}, &errs, func(k string) string { return env[k] })
		}()
		deadline := time.After(10 * time.Second)
		for {
			select {
			case err := <-done:
				return errs.String(), err
			case <-deadline:
				t.Fatalf("%s: neither listening nor done in 10s; stderr:\n%s", strings.Join(args, " "), errs.String())
			case <-time.After(10 * time.Millisecond):
				if strings.Contains(errs.String(), " listening") {
					cancel()
					return errs.String(), <-done
				}
			}
		}
	}
	t.Run("a listed flag is read", func(t *testing.T) {
		t.Parallel()
		out, err := run(t, nil, "fake-llm", "--addr", "127.0.0.1:0", "--log-format", "text")
		if err != nil || !strings.Contains(out, `msg="fake-llm listening"`) {
			t.Fatalf("fake-llm --log-format text: %v, log not in text:\n%s", err, out)
		}
	})
	t.Run("a listed variable is read", func(t *testing.T) {
		t.Parallel()
		out, err := run(t, map[string]string{"ONCEFLOW_LOG_FORMAT": "text"}, "webhook-sink", "--addr", "127.0.0.1:0")
		if err != nil || !strings.Contains(out, `msg="webhook sink listening"`) {
			t.Fatalf("webhook-sink with ONCEFLOW_LOG_FORMAT=text: %v, log not in text:\n%s", err, out)
		}
	})
	t.Run("an unlisted flag is accepted", func(t *testing.T) {
		t.Parallel()
		out, err := run(t, nil, "fake-llm", "--addr", "127.0.0.1:0", "--database-url", "postgres://db.example/app",
			"--api-keys", "acme:key-acme-0123456789")
		if err != nil || !strings.Contains(out, "fake-llm listening") {
			t.Fatalf("fake-llm with --database-url and --api-keys: %v\n%s", err, out)
		}
	})
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want string
	}{
		{nil, []string{"fake-llm", "--claim-idle", "abc"}, `invalid --claim-idle="abc"`},
		{map[string]string{"ONCEFLOW_CLAIM_IDLE": "abc"}, []string{"fake-llm"}, `invalid ONCEFLOW_CLAIM_IDLE="abc"`},
		{map[string]string{"ONCEFLOW_DATABASE_URL": "mysql://db"}, []string{"webhook-sink"}, `invalid ONCEFLOW_DATABASE_URL="mysql://db"`},
		{nil, []string{"probe", "--database-url", "postgres://db.example/app", "--base-url", "ftp://x", "--model", "m"}, "http or https"},
	} {
		t.Run("checked: "+strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			out, err := run(t, tc.env, tc.args...)
			if code := cli.ExitCode(err); code != 2 || !strings.Contains(out, tc.want) {
				t.Fatalf("exit %d (%v), want 2 with %q; stderr:\n%s", code, err, tc.want, out)
			}
		})
	}
}

// A program's own commands (App.Commands) run beside the built-in ones, are listed by
// help, and their errors map to exit statuses as the built-ins' do; a program without
// them does not have the onceflow binary's fake-llm and webhook-sink.
func TestAppCommandsRunBesideTheBuiltInOnes(t *testing.T) {
	t.Parallel()
	greet := cli.Command{Name: "greet", Summary: "say hello", Run: func(ctx context.Context, e cli.Env, args []string) error {
		fs := e.Flags("greet", "[--to NAME]")
		to := fs.String("to", "world", "whom to greet")
		if err := e.Parse(fs, args); err != nil {
			return err
		}
		if *to == "" {
			return cli.UsageErrorf("greet: --to must not be empty")
		}
		_, err := io.WriteString(e.Stdout, e.Name+" says hello to "+*to+" "+e.Getenv("GREETING_SUFFIX")+"\n")
		return err
	}}
	app := cli.App{Name: "notesd", Commands: []cli.Command{greet}}
	getenv := func(k string) string { return map[string]string{"GREETING_SUFFIX": "!"}[k] }
	runApp := func(app cli.App, args ...string) (string, string, int) {
		var out, errs bytes.Buffer
		err := cli.Run(context.Background(), app, args, &out, &errs, getenv)
		return out.String(), errs.String(), cli.ExitCode(err)
	}
	if out, errs, code := runApp(app, "greet", "--to", "ann"); code != 0 || out != "notesd says hello to ann !\n" {
		t.Errorf("greet --to ann: exit %d, stdout %q, stderr %q", code, out, errs)
	}
	if _, errs, code := runApp(app, "greet", "--to", ""); code != 2 || !strings.Contains(errs, "notesd: greet: --to must not be empty") {
		t.Errorf("greet --to '': exit %d, want 2; stderr %q", code, errs)
	}
	if _, errs, code := runApp(app, "greet", "--from", "bob"); code != 2 || !strings.Contains(errs, "flag provided but not defined: -from") {
		t.Errorf("greet --from bob: exit %d, want 2 (a bad flag); stderr %q", code, errs)
	}
	if _, errs, code := runApp(app, "greet", "-h"); code != 0 || !strings.Contains(errs, "usage: notesd greet [--to NAME]") || !listed(errs, "to") {
		t.Errorf("greet -h: exit %d, want 0 with its usage; stderr %q", code, errs)
	}
	out, _, code := runApp(app, "help")
	if code != 0 || !strings.Contains(out, "\n  greet ") || !strings.Contains(out, "\n  migrate ") {
		t.Errorf("help: exit %d, does not list greet and the built-ins:\n%s", code, out)
	}
	for _, name := range []string{"fake-llm", "webhook-sink"} {
		if strings.Contains(out, "\n  "+name+" ") {
			t.Errorf("help of a program without %s lists it:\n%s", name, out)
		}
		if _, errs, code := runApp(app, name); code != 2 || !strings.Contains(errs, `unknown command "`+name+`"`) {
			t.Errorf("%s in a program without it: exit %d, want 2; stderr %q", name, code, errs)
		}
	}
	for _, bad := range [][]cli.Command{
		{{Name: "serve", Run: greet.Run}},
		{greet, greet},
		{{Name: "greet"}},
	} {
		if _, errs, code := runApp(cli.App{Commands: bad}, "version"); code != 2 || !strings.Contains(errs, "cli.App.Commands[") {
			t.Errorf("App.Commands %v: exit %d, want 2; stderr %q", bad, code, errs)
		}
	}
}

// helpCommands are every command and subcommand with a -h of its own.
var helpCommands = [][]string{
	{"migrate"}, {"serve"}, {"work"}, {"run"}, {"audit"}, {"relay"},
	{"dlq"}, {"dlq", "list"}, {"dlq", "replay"}, {"dlq", "purge"},
	{"outbox"}, {"outbox", "list"}, {"outbox", "retry"},
	{"approvals"}, {"approvals", "list"}, {"approvals", "approve"}, {"approvals", "reject"},
	{"indoubt"}, {"indoubt", "list"}, {"indoubt", "resolve"},
	{"shadow"}, {"shadow", "report"}, {"batches"}, {"batches", "list"}, {"batches", "cancel"}, {"eval"},
	{"tenants"}, {"tenants", "set"}, {"tenants", "delete"}, {"tenants", "list"},
	{"gateway"}, {"probe"}, {"fake-llm"}, {"webhook-sink"}, {"version"},
}

// No flag's -h line shows a phrase as its value name: the flag package takes the first
// back-quoted words of a usage string for the value's name ("-failed onceflow outbox
// retry"), so a usage string must not quote a command.
func TestNoFlagShowsAPhraseAsItsValueName(t *testing.T) {
	t.Parallel()
	flagLine := regexp.MustCompile(`^  -([a-z0-9-]+)(?: (.*))?$`)
	for _, args := range helpCommands {
		usage := help(t, args...)
		for line := range strings.SplitSeq(usage, "\n") {
			m := flagLine.FindStringSubmatch(line)
			if m != nil && strings.ContainsAny(m[2], " `") {
				t.Errorf("%s -h: -%s has the value name %q", strings.Join(args, " "), m[1], m[2])
			}
		}
	}
}

// docRef matches what help text cites of the repository's documentation: a Markdown
// file (docs/configuration.md) or the README, with the section after it when one is
// quoted (README, "Configuration").
var docRef = regexp.MustCompile(`\b((?:[a-z0-9_-]+/)*[A-Za-z0-9_-]+\.md|README)\b(?:, "([^"]+)")?`)

// Every document `help` and the commands' -h cite exists in the repository, and so does
// every section they name in it.
func TestHelpCitesOnlyDocumentsThatExist(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	if err := cli.Run(context.Background(), helpApp, []string{"help"}, &out, io.Discard, func(string) string { return "" }); err != nil {
		t.Fatalf("help: %v", err)
	}
	texts := map[string]string{"help": out.String()}
	for _, args := range helpCommands {
		texts[strings.Join(args, " ")+" -h"] = help(t, args...)
	}
	cited := 0
	for name, text := range texts {
		for _, m := range docRef.FindAllStringSubmatch(text, -1) {
			cited++
			path := m[1]
			if path == "README" {
				path = "README.md"
			}
			b, err := os.ReadFile(filepath.Join("..", path)) // the module root, from cli
			if err != nil {
				t.Errorf("%s cites %s, which is not in the repository: %v", name, m[0], err)
				continue
			}
			if m[2] != "" && !regexp.MustCompile(`(?m)^#+ `+regexp.QuoteMeta(m[2])+`\s*$`).Match(b) {
				t.Errorf("%s cites %s, which has no section %q", name, path, m[2])
			}
		}
	}
	if cited == 0 {
		t.Error("no help text cites a document: the settings' reference should be cited")
	}
}

// The -h of a command with subcommands lists them and says how to see each one's flags.
func TestParentCommandHelpListsItsSubcommandsAndHowToSeeTheirFlags(t *testing.T) {
	t.Parallel()
	for parent, subs := range map[string][]string{
		"dlq":       {"list", "replay", "purge"},
		"outbox":    {"list", "retry"},
		"approvals": {"list", "approve", "reject"},
		"indoubt":   {"list", "resolve"},
		"shadow":    {"report"},
		"batches":   {"list", "cancel"},
		"tenants":   {"set", "delete", "list"},
	} {
		usage := help(t, parent)
		for _, sub := range subs {
			if !regexp.MustCompile(`\b` + sub + `\b`).MatchString(usage) {
				t.Errorf("%s -h does not list %s:\n%s", parent, sub, usage)
			}
		}
		if hint := "onceflow " + parent + " SUBCOMMAND -h"; !strings.Contains(usage, hint) {
			t.Errorf("%s -h does not say %q:\n%s", parent, hint, usage)
		}
	}
}

// The settings of shadows and of the batch lane are listed by the commands that run
// model steps (work, run), and not by probe and gateway, which make their own calls.
func TestOnlyTheCommandsRunningModelStepsListTheShadowAndBatchSettings(t *testing.T) {
	t.Parallel()
	lane := []string{"shadow", "summaries-lane", "batch-max-items", "batch-max-age", "batch-poll-interval", "batch-max-size",
		"batch-enqueued-tokens"}
	for _, cmd := range []string{"work", "run"} {
		usage := help(t, cmd)
		for _, f := range lane {
			if !listed(usage, f) {
				t.Errorf("%s -h does not list --%s:\n%s", cmd, f, usage)
			}
		}
	}
	for _, cmd := range []string{"probe", "gateway", "serve", "eval"} {
		usage := help(t, cmd)
		for _, f := range lane {
			if listed(usage, f) {
				t.Errorf("%s -h lists --%s, which it does not read:\n%s", cmd, f, usage)
			}
		}
	}
}
