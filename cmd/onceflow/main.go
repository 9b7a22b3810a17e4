// Command onceflow is the onceflow service: one binary whose subcommands run the API,
// the workers, the outbox relay and the operator tools. Run `onceflow help` for the
// list; the subcommands live in package cli, which a program of one's own embeds.
package main

import "github.com/onceflow/onceflow/cli"

func main() { cli.Main(cli.App{}) }
