// Command onceflow is the onceflow service: one binary whose subcommands run the API,
// the workers, the outbox relay and the operator tools. Run `onceflow help` for the
// list. The subcommands live in package cli, which a program of one's own embeds with
// its own workflows; the service this binary hosts, the summaries workflow, is package
// service. This binary is the reference: it has every model provider (openai,
// anthropic, fake) and every command of package cli, fake-llm and webhook-sink among
// them, which a program of one's own links only when it lists them.
package main

import (
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/cli/anthropicprovider"
	"github.com/onceflow/onceflow/cli/fakellm"
	"github.com/onceflow/onceflow/cli/openaiprovider"
	"github.com/onceflow/onceflow/cli/webhooksink"
	"github.com/onceflow/onceflow/service"
)

func main() {
	cli.Main(cli.App{
		Workflows: service.Workflows, Audit: service.Audit,
		Providers: []cli.Provider{openaiprovider.Provider(), anthropicprovider.Provider()},
		Commands:  []cli.Command{fakellm.Command(), webhooksink.Command()},
	})
}
