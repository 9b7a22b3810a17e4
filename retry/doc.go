// Package retry retries only what can succeed, within a deadline budget.
//
// It is the generic layer under onceflow's model calls and webhook sends, and imports
// nothing but the standard library. Four ideas, one file each:
//
//   - Classification (classify.go): Classify turns an error into a Verdict: retryable
//     or not, a Class usable as a bounded metrics label, and the server's Retry-After
//     hint. Timeouts of one attempt, connection resets and refusals, DNS failures, TLS
//     handshake timeouts and truncated bodies are retried; so are HTTP 408, 409, 429
//     and every 5xx, except a 429 whose provider error says a quota or spend limit is
//     exhausted. An x-should-retry header, when present, wins. Everything else,
//     unknown errors included, is permanent: unknown means bug until proven otherwise.
//     Errors expose what classification needs through small interfaces (HTTPStatuser,
//     RetryAfterer, ShouldRetrier, ProviderCoder); package llm's *APIError and this
//     package's *StatusError implement them.
//   - Full-jitter backoff (backoff.go): the n-th retry sleeps a uniformly random time in
//     [0, min(Cap, Base·2ⁿ)], so clients that failed together do not retry together.
//   - Retry-After (retryafter.go): retry-after-ms, then Retry-After as delta-seconds or
//     an HTTP-date, honoured when present and capped.
//   - Budgets (deadline.go, do.go): each attempt runs under a real context deadline of
//     min(PerCallTimeout, deadline remaining), which an HTTP client honours for the whole
//     exchange, body included, so a server dripping one byte a second cannot hold a call
//     open; a Deadline on the monotonic clock bounds the whole delivery, and Do stops
//     when the next sleep would leave less than one useful attempt (MinAttempt).
//
// Do's own stops are errors of their own: *DeadlineExceededError (errors.Is
// ErrDeadlineExceeded) is never retried in-process, because the queue redelivers with
// a fresh budget; *ExhaustedError wraps the last retryable error after MaxAttempts.
// Transient tells a job handler which failures to hand back for redelivery and which
// to dead-letter.
//
// Clock and randomness are injectable (Policy.Clock, Policy.Rand), so tests never sleep
// for real, and Policy.OnRetry observes every retry for logs and metrics.
package retry
