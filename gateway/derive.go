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
// the window, unless its call was recorded more than $3 ago: an SDK retries within
// seconds of a failed attempt (its longest backoff is 8 s, a Retry-After at most 60 s),
// so a later request with the same fingerprint is the retry of a new request whose first
// attempt never reached the gateway, and gets a call of its own. The call's success
// time is its llm_calls row's updated_at, which nothing changes after the success.
//
//	$1 fingerprint, $2 window µs, $3 grace µs
const findDerivedSQL = `SELECT d.idem_key FROM gateway_derived_keys d
LEFT JOIN llm_calls c ON c.idem_key = d.idem_key
WHERE d.fingerprint = $1 AND d.seen_at > now() - $2::bigint * interval '1 microsecond'
	AND (c.state IS DISTINCT FROM 'succeeded' OR c.updated_at > now() - $3::bigint * interval '1 microsecond')`

// derivedRetryGrace is how long after its call was recorded a note is still offered to
// retries.
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
		g.passThrough(w, r) // not an SDK's count: a request without a key
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
			g.ledgerUnavailable(r.Context(), w, "gateway: derived keys unavailable", err)
			return
		}
	}
	if key == "" { // a first attempt, or a retry of one the gateway never saw
		var b [16]byte
		_, _ = rand.Read(b[:])
		key = "gwd-" + hex.EncodeToString(b[:])
		if _, err := g.cfg.DB.Exec(ctx, noteDerivedSQL, fingerprint, key); err != nil {
			g.ledgerUnavailable(r.Context(), w, "gateway: derived keys unavailable", err)
			return
		}
	}
	g.record(w, r, key, hash, body)
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
