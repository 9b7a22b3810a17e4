// Package limiter is the admission control of model calls for a fleet of processes:
// fleet-wide requests per minute, tokens per minute and calls in flight per model
// (configured, or learnt from the provider's rate-limit headers), a pause of the whole
// fleet on one 429 or exhausted quota, fair shares between tenants, a cap on one
// tenant's calls in flight, and daily token budgets per tenant reserved before a call
// and settled with its usage after. Its state is in Redis, changed only by atomic Lua
// scripts (scripts.go describes every key), so processes agree without talking to
// each other.
//
// A call asks Limiter.Acquire for a Permit, makes the call, and ends the permit with
// Permit.Done and what came back. Wrap and WrapAround do both around an llm.Client.
// A call that must wait longer than Config.MaxWait gets a *retry.WaitError instead
// (its job waits in its queue, spending no attempt). Limiter.Run keeps the process's
// view fresh (pauses announced over Pub/Sub, learnt limits, the tenants' budgets) and
// retries the settlements Redis could not take.
//
// Failure model: with Redis unreachable, an Acquire that needs it (a limit, a budget,
// a tenant cap, a model's first call in the process or its recovery after a pause)
// fails with an error matching retry.ErrUnavailable and no call is made; a settlement that fails is kept and
// retried (its budget part is idempotent, so a retry after a lost reply charges
// once); a permit whose process died ends with its lease, its budget reservation
// charged whole. Every decision reads Redis' clock, never the processes'. The design,
// settings and trade-offs are in docs/limits.md.
package limiter
