package gateway

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Keys without code changes (Config.DeriveKeys = DeriveRetryCount): the official OpenAI
// and Anthropic SDKs send no Idempotency-Key, but they number their attempts of one
// request in X-Stainless-Retry-Count (0 for the first, 1 and 2 for their automatic
// retries) and resend the identical body with the identical credentials. The gateway
// gives a first attempt (count 0) a fresh key of its own, noted in
// gateway_derived_keys under the fingerprint of its credential scope and request; a
// retry (count >= 1) with the same fingerprint within Config.DeriveWindow is answered
// from that key's call: joined while in flight, replayed once recorded, taken over if
// it failed. What this can and cannot tell is in docs/providers.md.

// DeriveRetryCount is the value of Config.DeriveKeys (ONCEFLOW_GATEWAY_DERIVE_KEYS)
// that derives keys from X-Stainless-Retry-Count.
const DeriveRetryCount = "retry-count"

// HeaderRetryCount is the header in which the official SDKs number the attempts of one
// request: 0 for the first.
const HeaderRetryCount = "X-Stainless-Retry-Count"

// noteDerivedSQL notes a first attempt's key under its fingerprint: the latest first
// attempt wins.
//
//	$1 fingerprint, $2 idem_key
const noteDerivedSQL = `INSERT INTO gateway_derived_keys (fingerprint, idem_key, seen_at) VALUES ($1, $2, now())
ON CONFLICT (fingerprint) DO UPDATE SET idem_key = EXCLUDED.idem_key, seen_at = EXCLUDED.seen_at, answered_at = NULL`

// findDerivedSQL finds the key of the latest first attempt with a fingerprint within
// the window.
//
//	$1 fingerprint, $2 window µs
//
// A note whose call was answered more than derivedRetryGrace ago is not offered: an SDK
// retries within seconds of a failed attempt.
const findDerivedSQL = `SELECT idem_key FROM gateway_derived_keys
WHERE fingerprint = $1 AND seen_at > now() - $2::bigint * interval '1 microsecond'
	AND (answered_at IS NULL OR answered_at > now() - $3::bigint * interval '1 microsecond')`

// answeredSQL notes when a note's call was first answered.
//
//	$1 fingerprint, $2 idem_key
const answeredSQL = `UPDATE gateway_derived_keys SET answered_at = now()
WHERE fingerprint = $1 AND idem_key = $2 AND answered_at IS NULL`

// derivedRetryGrace is how long after its call was answered a note is still offered to
// retries: the SDKs' longest backoff is 8 s, and they wait a Retry-After of up to 60 s.
const derivedRetryGrace = time.Minute

// purgeDerivedSQL deletes notes older than the window, a batch at a time.
//
//	$1 window µs
const purgeDerivedSQL = `DELETE FROM gateway_derived_keys WHERE fingerprint IN (
	SELECT fingerprint FROM gateway_derived_keys WHERE seen_at < now() - $1::bigint * interval '1 microsecond' LIMIT 1000)`

// derived serves a request without a key that carries X-Stainless-Retry-Count.
func (g *Gateway) derived(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.Atoi(strings.TrimSpace(r.Header.Get(HeaderRetryCount)))
	if err != nil || n < 0 || len(r.Header.Values(HeaderRetryCount)) > 1 {
		// Not an SDK's count: the request is passed through as one without a key.
		g.requests.WithLabelValues(resultPassthrough).Inc()
		ctx, cancel := context.WithTimeout(r.Context(), g.cfg.Timeout)
		defer cancel()
		g.passThrough(ctx, w, r)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		g.bodyError(w, err)
		return
	}
	hash := requestHash(r, body)
	fp := sha256.Sum256([]byte("onceflow.gateway.derived.v1\n" + scopeOf(r.Header, g.credentials).digest + "\n" + hash))
	fingerprint := hex.EncodeToString(fp[:])
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	key := ""
	if n >= 1 {
		err := g.cfg.DB.QueryRow(ctx, findDerivedSQL, fingerprint, g.cfg.DeriveWindow.Microseconds(), derivedRetryGrace.Microseconds()).Scan(&key)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			g.derivedUnavailable(w, r, err)
			return
		}
	}
	if key == "" { // a first attempt, or a retry of one the gateway never saw
		var b [16]byte
		_, _ = rand.Read(b[:])
		key = "gwd-" + hex.EncodeToString(b[:])
		if _, err := g.cfg.DB.Exec(ctx, noteDerivedSQL, fingerprint, key); err != nil {
			g.derivedUnavailable(w, r, err)
			return
		}
	}
	sw := &statusWriter{ResponseWriter: w}
	g.record(sw, r, key, hash, body) // a stream cut short panics past what follows
	if sw.status < 200 || sw.status > 299 {
		return
	}
	// Answered (whether or not every byte reached the client: its retry comes soon).
	mctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 5*time.Second)
	defer cancel()
	if _, err := g.cfg.DB.Exec(mctx, answeredSQL, fingerprint, key); err != nil {
		// The note stays offered for the whole window, as if the call were still running.
		g.log.WarnContext(r.Context(), "gateway: could not note a derived key's answer", "err", err)
	}
}

func (g *Gateway) derivedUnavailable(w http.ResponseWriter, r *http.Request, err error) {
	g.requests.WithLabelValues(resultUnavailable).Inc()
	g.log.ErrorContext(r.Context(), "gateway: derived keys unavailable", "err", err)
	retryAfter(w, time.Second)
	writeError(w, http.StatusServiceUnavailable, "server_error", "ledger_unavailable", "the idempotency ledger is unavailable; retry later")
}

// Run runs the gateway's background work until ctx ends: the ledger's purge of expired
// rows (Ledger.Run) and, with DeriveKeys, the purge of derived keys older than
// DeriveWindow. It returns nil when ctx ends.
func (g *Gateway) Run(ctx context.Context) error {
	if g.cfg.DeriveKeys == "" {
		return g.ledger.Run(ctx)
	}
	done := make(chan error, 1)
	go func() { done <- g.ledger.Run(ctx) }()
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return <-done
		case <-tick.C:
			g.purgeDerived(ctx)
		}
	}
}

// purgeDerived deletes the derived-key notes older than the window, a batch per
// statement, until none is left.
func (g *Gateway) purgeDerived(ctx context.Context) {
	for ctx.Err() == nil {
		pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		tag, err := g.cfg.DB.Exec(pctx, purgeDerivedSQL, g.cfg.DeriveWindow.Microseconds())
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				g.log.WarnContext(ctx, "gateway: could not purge old derived keys; will try again", "err", err)
			}
			return
		}
		if tag.RowsAffected() < purgeDerivedBatch {
			return
		}
	}
}

// purgeDerivedBatch is the LIMIT of purgeDerivedSQL.
const purgeDerivedBatch = 1000
