// Command onceflow is the onceflow service: one binary whose subcommands run the API,
// the workers, the outbox relay and the operator tools. Run `onceflow help` for the
// list. The subcommands live in package cli, which a program of one's own embeds with
// its own workflows; the service this binary hosts, the summaries workflow, is package
// service.
package main

import (
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/service"
)

func main() { cli.Main(cli.App{Workflows: service.Workflows, Audit: service.Audit}) }
