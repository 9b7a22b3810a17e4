package service_test

import (
	"context"
	"fmt"
	"io"

	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/service"
)

// The onceflow binary is this App. Its queue is the summaries workflow's; a queue it
// does not host is a usage error (exit 2), found before any connection is made.
func ExampleWorkflows() {
	app := cli.App{Workflows: service.Workflows, Audit: service.Audit}
	env := map[string]string{
		"ONCEFLOW_REDIS_URL":    "redis://localhost:6379/0",
		"ONCEFLOW_DATABASE_URL": "postgres://localhost/app",
	}
	err := cli.Run(context.Background(), app, []string{"work", "--queue", "mail"}, io.Discard, io.Discard,
		func(k string) string { return env[k] })
	fmt.Println(cli.ExitCode(err), err)
	// Output: 2 --queue "mail": no such queue; this program's queues: summaries
}
