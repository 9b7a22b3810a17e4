// Package summaries is onceflow's reference workflow, built on the public API only
// (docs/workflows-summaries.md): a POST that accepts a text to summarise under an
// Idempotency-Key (onceflow.Route), a job of kind "summary" whose Worker calls the model
// through the ledger under the retry policy and the delivery's budget (Job.Complete), and
// one transaction (Job.Commit) that stores the summary together with the intent to email
// it, which the outbox relay then sends. Workflow returns it for onceflow.Config.Workflows.
package summaries
