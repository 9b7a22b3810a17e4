// Package idempotency makes net/http handlers safe to retry under the Idempotency-Key
// request header (draft-ietf-httpapi-idempotency-key-header): the first request with a
// key runs the handler and its response is stored; a retry with the same key and the
// same request gets the stored response with Idempotent-Replayed: true; the same key
// while the first request runs gets 409 with Retry-After; the same key with a different
// request gets 422.
//
// A key is scoped by tenant, method and path (Scope). The tenant comes from
// Config.Tenant, the authenticated principal, never from a header. Requests are compared
// by Fingerprint, the SHA-256 of a canonical form the route supplies (CanonicalJSON for
// JSON bodies by default), so insignificant whitespace is not a different request.
//
// Middleware.Wrap is the generic path for handlers that do arbitrary work: the key is
// claimed before the handler runs (an in-progress marker with a random token and the
// lock TTL) and completed after it with a compare-and-set on that token, two store round
// trips in all; a 5xx, an error or a panic releases the key instead. Routes whose only
// work is an enqueue use redisstore.Store.Accept, which checks the key, enqueues and
// stores the response in one atomic step, and answer with Middleware.Respond.
//
// Store is the storage seam; idempotency/redisstore implements it on Redis and
// idempotency/storetest is the conformance suite implementations pass. See
// docs/idempotency.md for the status table, the TTL trade-offs and the failure
// behaviour.
package idempotency
