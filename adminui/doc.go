// Package adminui is onceflow's operator UI: server-rendered pages, under /ui/ of
// `onceflow serve` and `onceflow run` when ONCEFLOW_ADMIN_KEYS is set, or mounted by a
// program of its own on any mux (New returns an http.Handler for the paths under
// Config.Base).
//
// It shows and acts on what a Client holds: every queue's numbers and last hour, the
// dependencies' breakers, the limiter's state per model and the model use by tenant
// (the overview); the dead letters, which it replays and purges one at a time or in
// bulk, with the same operations as `onceflow dlq`; the outbox's unsent, failing and
// exhausted effects, which it retries as `onceflow outbox retry` does; the model-call
// ledger with its rate of ambiguous failures; the shadow report (how shadow candidates
// agree with production, at what latency and cost, and their worst disagreements beside
// production's answers); and one job's whole trail (its enqueue,
// delivery, dead letters, model calls and tool-call keys, commit, effects and sends),
// found by its id, an effect's dedupe key or the idempotency key it was created with.
//
// Security. Only admin keys open it (Config.AdminKeys; tenant API keys never do). A
// sign-in stores a session in Redis, so that every process serving the UI knows it and
// signing out ends it everywhere; the browser holds a random token in an HttpOnly,
// SameSite=Strict cookie (Secure over TLS). Every state-changing request is a POST that
// must carry the session's CSRF token and, when it says where it comes from (a
// browser's Origin or Sec-Fetch-Site), come from the UI's own host. Sign-in attempts
// are counted per address in Redis, before the key is compared, and refused past
// Config.LoginAttempts in a minute (a success gives its attempt back). Pages forbid
// framing and foreign scripts (Content-Security-Policy).
//
// The pages need no JavaScript to read or to act; with it, their numbers refresh
// every 5 seconds. Everything is embedded in the binary.
package adminui
