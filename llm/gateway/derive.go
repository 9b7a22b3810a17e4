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
ON CONFLICT (fingerprint) DO UPDATE SET idem_key = EXCLUDED.idem_key, seen_at = EXCLUDED.seen_at`

// findDerivedSQL finds the key of the latest first attempt with a fingerprint within
// the window.
//
//	$1 fingerprint, $2 window µs
const findDerivedSQL = `SELECT idem_key FROM gateway_derived_keys
WHERE fingerprint = $1 AND seen_at > now() - $2::bigint * interval '1 microsecond'`

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
		err := g.cfg.DB.QueryRow(ctx, findDerivedSQL, fingerprint, g.cfg.DeriveWindow.Microseconds()).Scan(&key)
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
	g.record(w, r, key, hash, body)
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
			pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			if _, err := g.cfg.DB.Exec(pctx, purgeDerivedSQL, g.cfg.DeriveWindow.Microseconds()); err != nil && ctx.Err() == nil {
				g.log.WarnContext(ctx, "gateway: could not purge old derived keys; will try again", "err", err)
			}
			cancel()
		}
	}
}
