// Package outbox delivers side effects that were committed as rows of a transactional
// outbox: the result of a job and the intent to notify someone commit in one database
// transaction (see package pgoutbox), and a Relay sends each intent with a Sender
// afterwards, passing the row's dedupe key to the provider as its idempotency key.
//
// # Guarantees
//
// A row is sent at least once. It is sent more than once only when a relay dies (or
// loses its database) between the provider accepting a send and the relay recording
// it, and then always with the same dedupe key, so a provider that honours idempotency
// keys turns that window into exactly one effect. Several relays may run side by side:
// a row is claimed by one relay at a time under a lease (Config.Lease), so no database
// lock is held across a network call, and a relay whose lease ran out cannot mark a row
// another relay has claimed since (fencing).
//
// # Failures
//
// A Sender reports failure by returning an error. Permanent(err) means "do not retry":
// the row is exhausted at once and waits for a person. Any other error is retried with
// full-jitter exponential backoff (Config.BackoffBase, Config.BackoffCap), or after the
// delay the error carries when it implements RetryAfter() time.Duration (an HTTP
// Retry-After header), until Config.MaxAttempts attempts have failed; then the row is
// exhausted too. Unavailable(err) means "the dependency is down, not the row": the
// attempt is not counted and the row is never exhausted for it; it is tried again after
// a delay that grows with the outage (up to Config.BackoffCap), so it is sent once the
// dependency is back.
//
// # Routing by topic
//
// A Router (NewRouter) is the Sender of a process that sends several topics: a sender
// per topic or per prefix ("payments.refund", "email."), the longest match winning. A
// Relay whose Sender is a Router claims only the rows of the Router's topics
// (TopicStore.ClaimTopics), so a row whose topic has no sender here is left, unattempted
// and never exhausted, to a process that has one.
package outbox
