package cli_test

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/fakellm"
	"github.com/onceflow/onceflow/cli/openaiprovider"
)

// A program of one's own hosts its workflows with every onceflow subcommand (migrate,
// serve, work --queue, relay, run, dlq, outbox, audit): its main is
//
//	func main() { cli.Main(app) }
//
// Run is the same, for tests and for programs that add commands of their own; its
// error's ExitCode is the command's exit status (2: a queue the program does not have).
func ExampleRun() {
	app := cli.App{Name: "notesd", Workflows: func(h cli.Host) ([]onceflow.Workflow, error) {
		return []onceflow.Workflow{notesWorkflow(h)}, nil
	}}
	env := map[string]string{
		"ONCEFLOW_REDIS_URL":    "redis://localhost:6379/0",
		"ONCEFLOW_DATABASE_URL": "postgres://localhost/app",
	}
	err := cli.Run(context.Background(), app, []string{"work", "--queue", "mail"}, os.Stdout, io.Discard,
		func(k string) string { return env[k] })
	fmt.Println(cli.ExitCode(err), err)
	// Output: 2 --queue "mail": no such queue; this program's queues: notes
}

// A program links the model providers and the commands it lists, and no other: this one
// has OpenAI (and the built-in fake) and fake-llm, not Anthropic nor webhook-sink.
// ONCEFLOW_LLM naming a provider it does not list stops every command, before any
// connection, with a line naming the package to import (exit 2). The onceflow binary
// lists openaiprovider, anthropicprovider, fakellm and webhooksink.
func ExampleApp_providers() {
	app := cli.App{Name: "notesd",
		Providers: []cli.Provider{openaiprovider.Provider()},
		Commands:  []cli.Command{fakellm.Command()},
	}
	env := map[string]string{"ONCEFLOW_LLM": "anthropic"}
	err := cli.Run(context.Background(), app, []string{"migrate"}, io.Discard, io.Discard,
		func(k string) string { return env[k] })
	fmt.Println(cli.ExitCode(err), err)
	// Output: 2 invalid ONCEFLOW_LLM="anthropic": this program does not link the anthropic provider (it has fake, openai): import "github.com/onceflow/onceflow/cli/anthropicprovider" and list anthropicprovider.Provider() in cli.App.Providers
}

// A program adds commands of its own beside the built-in ones: Env gives the program's
// name, streams and environment, and the flags and settings as the built-in commands
// have them (a Load would read the ONCEFLOW_* settings); UsageErrorf is exit 2.
func ExampleCommand() {
	hello := cli.Command{Name: "hello", Summary: "greet someone", Run: func(ctx context.Context, e cli.Env, args []string) error {
		fs := e.Flags("hello", "[--to NAME]")
		to := fs.String("to", "", "whom to greet")
		if err := e.Parse(fs, args); err != nil {
			return err
		}
		if *to == "" {
			return cli.UsageErrorf("hello: --to is required")
		}
		_, err := fmt.Fprintf(e.Stdout, "%s: hello, %s\n", e.Name, *to)
		return err
	}}
	app := cli.App{Name: "notesd", Commands: []cli.Command{hello}}
	err := cli.Run(context.Background(), app, []string{"hello", "--to", "Ann"}, os.Stdout, io.Discard, os.Getenv)
	fmt.Println(cli.ExitCode(err))
	err = cli.Run(context.Background(), app, []string{"hello"}, os.Stdout, io.Discard, os.Getenv)
	fmt.Println(cli.ExitCode(err), err)
	// Output:
	// notesd: hello, Ann
	// 0
	// 2 hello: --to is required
}
