// Package onceflow gives LLM workflows exactly-once effects on top of at-least-once
// delivery.
//
// # The failure model
//
// An LLM step is a slow, rate-limited, sometimes hung network call between a user's
// request and a side effect someone will notice. onceflow designs for five failures, each
// answered by one mechanism in one folder:
//
//   - Clients retry, and the same POST arrives twice: an Idempotency-Key on every POST
//     that creates work, stored in Redis with a fingerprint of the body, and a job id
//     derived from the key (package idempotency).
//   - Processes die between steps: Redis Streams consumer groups redeliver what was not
//     acknowledged, reclaim what a dead worker held and dead-letter what keeps failing
//     (package queue), so every handler must be idempotent.
//   - The model API fails in two ways: a 429 or 503 will probably succeed later, a 400
//     never will. Only the first kind is retried, with full-jitter backoff that honours
//     Retry-After (package retry); provider adapters map SDK errors onto that
//     classification (package llm).
//   - Calls hang: every model call has a wall-clock timeout and every delivery a
//     monotonic deadline budget (package retry).
//   - Side effects escape transactions: the result and the intent to notify commit in one
//     PostgreSQL transaction, and a relay sends the intent with its dedupe key as the
//     provider's idempotency key (package outbox). For providers that ignore keys, a
//     ledger of model calls written before each request goes out dedupes on the client
//     side (package ledger).
//
// Exactly-once delivery is not on offer; exactly-once effects are, and that is what users
// see. The reference workflow that glues the parts together is package summaries; the
// service binary is cmd/onceflow.
package onceflow
