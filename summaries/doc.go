// Package summaries is onceflow's reference workflow (docs/api.md, docs/RELIABILITY.md): a POST that
// accepts a text to summarise under an Idempotency-Key, a queue job that calls the model
// under a retry policy and a deadline budget, and one PostgreSQL transaction that stores
// the summary together with the intent to email it, which the outbox relay then sends.
package summaries
