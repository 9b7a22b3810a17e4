package cli_test

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
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
