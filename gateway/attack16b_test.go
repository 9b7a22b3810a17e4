package gateway_test

// Attacks on issue 16's second pass: a stream's partial output written by a persister
// goroutine, the owner's client given the end of a complete stream before its record
// commits (the record made after the handler returned, Close waiting for it), and the
// follower writes committed with synchronous_commit off. Each test states what must
// hold; those that fail on the code they were written against say so.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
)

// phased is an upstream whose first call sends parts[0], then each next part once the
// gate before it is closed (gates[i] opens parts[i+1]); later calls send every part
// at once. It counts its calls.
type phased struct {
	parts []string
	gates []chan struct{}
	sent  chan struct{} // closed once parts[0] is out
	calls atomic.Int64
}

func newPhased(parts ...string) *phased {
	u := &phased{parts: parts, sent: make(chan struct{})}
	for range len(parts) - 1 {
		u.gates = append(u.gates, make(chan struct{}))
	}
	return u
}

func (u *phased) whole() string { return strings.Join(u.parts, "") }

func (u *phased) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	first := u.calls.Add(1) == 1
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	if !first {
		_, _ = io.WriteString(w, u.whole())
		return
	}
	for i, p := range u.parts {
		if i > 0 {
			select {
			case <-u.gates[i-1]:
			case <-r.Context().Done():
				return
			}
		}
		_, _ = io.WriteString(w, p)
		_ = rc.Flush()
		if i == 0 {
			close(u.sent)
		}
	}
}

// privateGateway is a gateway in front of up on a PostgreSQL of the test's own, which
// the test may stop, kill and restart; it returns the server, the gateway, its /v1 URL
// and a pool of the test's own on the same database.
func privateGateway(t *testing.T, up http.Handler, cfg gateway.Config) (*testenv.Server, *gateway.Gateway, string, *pgxpool.Pool) {
	t.Helper()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pg, dsn, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	gpool, err := connect.Postgres(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gpool.Close)
	cfg.Upstream, cfg.DB, cfg.Logger = ups.URL+"/v1", gpool, testenv.Logger(t)
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	return pg, g, gs.URL + "/v1", pool
}

// waitRow waits until cond holds of the row of key (read with pool, riding out a
// PostgreSQL restart), for up to 15 s, and returns the row.
func waitRow(t *testing.T, pool *pgxpool.Pool, key, what string, cond func(*ledger.Row) bool) *ledger.Row {
	t.Helper()
	l, err := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var last *ledger.Row
	var lastErr error
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		r, err := l.Get(context.Background(), key)
		if err == nil && cond(r) {
			return r
		}
		last, lastErr = r, err
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 15 s; the row: %+v %v", what, last, lastErr)
		}
	}
}

func announced(r *ledger.Row) bool { return r.Meta != nil }

// openAnnounced sends a keyed streaming request to url in front of up, reads the
// head up sends before it waits, and waits until the stream is announced on its row:
// the moment the tests below act. It returns the rest of the stream to read.
func openAnnounced(t *testing.T, up *gatedStream, url string, pool *pgxpool.Pool, key string) *bufio.Reader {
	t.Helper()
	fr := bufio.NewReader(openStream(t, url, key).Body)
	if got := readEvents(t, fr, 2); got != gatedHead {
		t.Fatalf("head: %q", got)
	}
	<-up.sent
	waitRow(t, pool, keyFor("Bearer sk", key), "the stream's announcement", announced)
	return fr
}

// readAllWithin reads r to its end, for up to d.
func readAllWithin(r io.Reader, d time.Duration) (string, error) {
	return within(d, fmt.Errorf("not at its end within %v", d), func() (string, error) {
		b, err := io.ReadAll(r)
		return string(b), err
	})
}

// within runs read on a goroutine of its own and returns what it returns, or late once
// d passed (read is left to finish on its own).
func within(d time.Duration, late error, read func() (string, error)) (string, error) {
	type result struct {
		s   string
		err error
	}
	ch := make(chan result, 1)
	go func() {
		s, err := read()
		ch <- result{s, err}
	}()
	select {
	case x := <-ch:
		return x.s, x.err
	case <-time.After(d):
		return "", late
	}
}

// holdRecord takes the row lock of key, so that the record of its answer (Succeed)
// waits; the returned func lets it go.
func holdRecord(t *testing.T, pool *pgxpool.Pool, key string) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1 FROM llm_calls WHERE idem_key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}
	var once atomic.Bool
	release = func() {
		if once.CompareAndSwap(false, true) {
			_ = tx.Rollback(ctx)
		}
	}
	t.Cleanup(release)
	return release
}

// gaugeOf reads the gauge name from reg.
func gaugeOf(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// A rolling deploy during a PostgreSQL failover: a stream completes while PostgreSQL is
// down, its client gets the end at once (its handler returned), and the HTTP server,
// with no handler left, lets the gateway Close. The answer was generated and passed on
// whole: Close must let its record wait for PostgreSQL (gateway.succeed retries for up
// to succeedPatience), or the row stays in_flight and the retry that follows the lease
// makes a second upstream call. Before ca7f867 the owner's handler held the server's
// shutdown (30 s by default) until the record committed.
//
// Found on d9faf4b: succeed's retry loop gives up as soon as Gateway.Close cancels
// g.base, although recordStream detached its context from Close; Close returns while
// PostgreSQL is down and the answer is never recorded.
func TestAttack16bCloseRightAfterTheEOFRecordsThroughAPostgresRestart(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	pg, g, url, pool := privateGateway(t, up, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "close-after-eof-pg-restart"
	row := keyFor("Bearer sk", key)
	fr := openAnnounced(t, up, url, pool, key)
	pg.Stop()
	close(up.release)
	if tail, err := readAllWithin(fr, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("the client's tail while PostgreSQL is down: %q %v", tail, err)
	}
	closed := make(chan error, 1)
	go func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		closed <- g.Close(cctx)
	}()
	closedEarly := false
	select {
	case err := <-closed:
		closedEarly = true
		closed <- err
	case <-time.After(3 * time.Second):
	}
	pg.Start()
	if err := <-closed; err != nil {
		t.Fatalf("Close: %v", err)
	}
	r := waitRow(t, pool, row, "readable row", func(*ledger.Row) bool { return true })
	if r.State != ledger.StateSucceeded || string(r.Raw) != gatedHead+gatedTail {
		t.Fatalf("after Close (returned while PostgreSQL was down: %v) the row is %s (owner %q): the answer its client got whole was not recorded, "+
			"and the next retry makes a second upstream call", closedEarly, r.State, r.Owner)
	}
}

// PostgreSQL is killed (SIGKILL) after the owner's client got the end of a complete
// stream and before its record committed (held up by a row lock, which the crash
// ends): the record commits once PostgreSQL is back, and a retry replays the same
// bytes. One upstream call.
func TestAttack16bPostgresKilledBetweenTheEOFAndTheCommit(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	pg, _, url, pool := privateGateway(t, up, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "pg-killed-after-eof"
	row := keyFor("Bearer sk", key)
	fr := openAnnounced(t, up, url, pool, key)
	holdRecord(t, pool, row)
	close(up.release)
	if tail, err := readAllWithin(fr, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("tail: %q %v", tail, err)
	}
	time.Sleep(100 * time.Millisecond) // the record waits on the lock
	pg.Kill()
	pg.Start()
	waitRow(t, pool, row, "the record after the crash", func(r *ledger.Row) bool {
		return r.State == ledger.StateSucceeded && string(r.Raw) == gatedHead+gatedTail
	})
	r, body, err := streamPost(t, url, key)
	if err != nil || body != gatedHead+gatedTail || r.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: replayed %q, %v\n%q", r.Header.Get("Idempotent-Replayed"), err, body)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// A retry with the same key arrives after the owner's client got the end of its stream
// and before the record commits (held up by a row lock): on the owner's process and on
// another, it joins and gets the identical bytes once the record commits, with no
// second upstream call; the joining gauges go back to 0; a later retry is a replay.
func TestAttack16bRetryBetweenTheEOFAndTheCommitJoins(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	fl := gatewaysOn(t, up, 2, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "retry-between-eof-and-commit"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, fl.urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 2); got != gatedHead {
		t.Fatalf("head: %q", got)
	}
	<-up.sent
	waitRow(t, fl.pool, row, "the stream's announcement", announced)
	release := holdRecord(t, fl.pool, row)
	close(up.release)
	if tail, err := readAllWithin(or, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("the owner's tail: %q %v", tail, err)
	}
	type answer struct {
		body string
		err  error
	}
	var answers [2]chan answer
	for i := range 2 {
		r := openStream(t, fl.urls[i], key)
		if r.StatusCode != http.StatusOK || r.Header.Get("Onceflow-Joined") != "true" {
			t.Fatalf("retry on gateway %d: %d %v, want a join", i, r.StatusCode, r.Header)
		}
		answers[i] = make(chan answer, 1)
		go func() {
			b, err := io.ReadAll(r.Body)
			answers[i] <- answer{string(b), err}
		}()
	}
	fl.waitJoining(t, 0, 1)
	fl.waitJoining(t, 1, 1)
	if r := waitRow(t, fl.pool, row, "row", func(*ledger.Row) bool { return true }); r.State != ledger.StateInFlight {
		t.Fatalf("the record was not held up: %s", r.State)
	}
	release()
	for i := range 2 {
		select {
		case a := <-answers[i]:
			if a.err != nil || a.body != gatedHead+gatedTail {
				t.Fatalf("retry on gateway %d: %q %v", i, a.body, a.err)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("retry on gateway %d did not end once the record committed", i)
		}
	}
	for i := range 2 {
		for deadline := time.Now().Add(10 * time.Second); gaugeOf(t, fl.regs[i], "onceflow_gateway_joining") != 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("gateway %d: onceflow_gateway_joining stays at %v", i, gaugeOf(t, fl.regs[i], "onceflow_gateway_joining"))
			}
		}
		if n := requestsWith(t, fl.regs[i], "joined"); n != 1 {
			t.Errorf("gateway %d: %v joined requests, want 1", i, n)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); requestsWith(t, fl.regs[0], "forwarded") != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the owner's call counted %v times as forwarded, want 1", requestsWith(t, fl.regs[0], "forwarded"))
		}
	}
	r, body, err := streamPost(t, fl.urls[0], key)
	if err != nil || body != gatedHead+gatedTail || r.Header.Get("Idempotent-Replayed") != "true" || r.Header.Get("Onceflow-Joined") != "" {
		t.Fatalf("a retry after the record: joined %q replayed %q %v", r.Header.Get("Onceflow-Joined"), r.Header.Get("Idempotent-Replayed"), err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// The limiter's permit of a stream is settled when the upstream's part ends, not when
// the record commits after the handler returned: under a tenant cap of one call in
// flight, the tenant's next call goes at once while the first one's record waits.
func TestAttack16bStreamPermitIsFreeBeforeTheRecordCommits(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, Provider: "openai", Logger: testenv.Logger(t),
		TenantConcurrency: 1, MaxWait: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	up := newGatedStream()
	fl := gatewaysOn(t, up, 1, gateway.Config{Limiter: lim, Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "permit-before-record"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, fl.urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 2); got != gatedHead {
		t.Fatalf("head: %q (status %d)", got, owner.StatusCode)
	}
	<-up.sent
	waitRow(t, fl.pool, row, "the stream's announcement", announced)
	release := holdRecord(t, fl.pool, row)
	close(up.release)
	if tail, err := readAllWithin(or, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("tail: %q %v", tail, err)
	}
	r, body, err := streamPost(t, fl.urls[0], "permit-before-record-2")
	if r.StatusCode != http.StatusOK || err != nil || body != gatedHead+gatedTail {
		t.Fatalf("the tenant's next call while the first one's record waits: %d %v %q (the permit is held by the background record)", r.StatusCode, err, body)
	}
	release()
	waitRow(t, fl.pool, row, "the record", func(r *ledger.Row) bool { return r.State == ledger.StateSucceeded })
	r, body, err = streamPost(t, fl.urls[0], "permit-before-record-3")
	if r.StatusCode != http.StatusOK || err != nil || body != gatedHead+gatedTail {
		t.Fatalf("a call after the record: %d %v %q", r.StatusCode, err, body)
	}
	if n := up.Calls(); n != 3 {
		t.Fatalf("%d upstream calls, want 3", n)
	}
}

// An upstream that drops mid-stream: the owner's client still sees its connection cut
// (an error, not a clean end), and the row records the cut as before, with everything
// received up to the last complete event kept as its partial output (finish(true)
// writes it whole although no batch was due), for the retry's Onceflow-Stream-Restarted.
func TestAttack16bCutStreamAbortsTheClientAndKeepsItsOutput(t *testing.T) {
	t.Parallel()
	const e1, e2, torn = "data: {\"choices\":[{\"delta\":{\"content\":\"one\"}}]}\n\n", "data: {\"choices\":[{\"delta\":{\"content\":\" two\"}}]}\n\n", "data: {\"choi"
	up := &sseUpstream{script: func(call int) ([]string, bool) {
		if call == 0 {
			return []string{e1, e2, torn}, true
		}
		return []string{goodStream}, false
	}}
	fl := gatewaysOn(t, up, 1, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "cut-stream-keeps-output"
	_, body, err := streamPost(t, fl.urls[0], key)
	if err == nil || body != e1+e2+torn {
		t.Fatalf("the cut stream's client: %q, err %v; want every byte received, then an error", body, err)
	}
	r := waitRow(t, fl.pool, keyFor("Bearer sk", key), "row", func(*ledger.Row) bool { return true })
	if r.State != ledger.StateInFlight || r.Owner != "" || r.Ambiguous != 1 || r.Partial != e1+e2 || r.PartialAttempt != 1 {
		t.Fatalf("the record of the cut: state %s owner %q ambiguous %d partial %q (attempt %d); want in_flight, released, 1, %q (1)",
			r.State, r.Owner, r.Ambiguous, r.Partial, r.PartialAttempt, e1+e2)
	}
	resp, body, err := streamPost(t, fl.urls[0], key)
	if err != nil || body != goodStream || resp.Header.Get(gateway.HeaderRestarted) != strconv.Itoa(len(e1+e2)) {
		t.Fatalf("retry: %q %v, restarted %q", body, err, resp.Header.Get(gateway.HeaderRestarted))
	}
	if n := up.Calls(); n != 2 {
		t.Fatalf("%d upstream calls, want 2", n)
	}
}

// A stream cut after more than maxPartialBytes (1 MiB): the client's connection is
// cut after every byte received, and the row's partial output is an exact prefix of the
// stream that ends at an event boundary, within the 1 MiB bound.
func TestAttack16bCutStreamBeyondOneMiB(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	for i := range 1500 {
		b.WriteString(bigEvent(i))
	}
	sent := b.String() + "data: {\"choi"
	up := &sseUpstream{script: func(call int) ([]string, bool) {
		if call == 0 {
			return []string{sent}, true
		}
		return []string{goodStream}, false
	}}
	fl := gatewaysOn(t, up, 1, gateway.Config{Timeout: 30 * time.Second})
	const key = "cut-stream-beyond-1mib"
	_, body, err := streamPost(t, fl.urls[0], key)
	if err == nil || body != sent {
		t.Fatalf("the cut stream's client: %d of %d bytes, err %v", len(body), len(sent), err)
	}
	r := waitRow(t, fl.pool, keyFor("Bearer sk", key), "row", func(*ledger.Row) bool { return true })
	if r.State != ledger.StateInFlight || r.Ambiguous != 1 || len(r.Partial) > 1<<20 || !strings.HasPrefix(sent, r.Partial) ||
		(r.Partial != "" && !strings.HasSuffix(r.Partial, "\n\n")) {
		t.Fatalf("the record of the cut: state %s ambiguous %d, partial of %d bytes (prefix %v)", r.State, r.Ambiguous, len(r.Partial), strings.HasPrefix(sent, r.Partial))
	}
	t.Logf("partial kept: %d bytes", len(r.Partial))
}

// A stream that is not valid UTF-8 (and holds a NUL): the partial column is text, so
// the persister stops before the first invalid segment; the owner's client, a joiner on
// its process and one on another process each get every byte as sent, and a retry
// replays them. One upstream call.
func TestAttack16bNonUTF8StreamIsPassedOnJoinedAndReplayedWhole(t *testing.T) {
	t.Parallel()
	up := newPhased(
		"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"\xff\xfe bad\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"nul \x00 here\"}}]}\n\ndata: [DONE]\n\n")
	fl := gatewaysOn(t, up, 2, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: 10 * time.Millisecond}})
	const key = "non-utf8-stream-0001"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, fl.urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 1); got != up.parts[0] {
		t.Fatalf("first event: %q", got)
	}
	waitRow(t, fl.pool, row, "the first event persisted", func(r *ledger.Row) bool { return r.Partial == up.parts[0] })
	close(up.gates[0])
	if got := readEvents(t, or, 1); got != up.parts[1] {
		t.Fatalf("second event: %q", got)
	}
	var joiners []*http.Response
	for i := range 2 {
		j := openStream(t, fl.urls[i], key)
		if j.Header.Get("Onceflow-Joined") != "true" {
			t.Fatalf("gateway %d: no join: %d", i, j.StatusCode)
		}
		joiners = append(joiners, j)
	}
	fl.waitJoining(t, 0, 1)
	fl.waitJoining(t, 1, 1)
	close(up.gates[1])
	if rest, err := readAllWithin(or, 15*time.Second); err != nil || rest != up.parts[2] {
		t.Fatalf("the owner's tail: %q %v", rest, err)
	}
	for i, j := range joiners {
		if got, err := readAllWithin(j.Body, 15*time.Second); err != nil || got != up.whole() {
			t.Fatalf("joiner on gateway %d: %q %v", i, got, err)
		}
	}
	r, body, err := streamPost(t, fl.urls[1], key)
	if err != nil || body != up.whole() || r.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %q %v", body, err)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// A follower on another process passes a stream on from the row's partial output, from
// the offset it reached. PostgreSQL crashes (SIGKILL; an OOM kill of any backend does
// the same) right after a relaxed AppendPartial committed; the owner's pool replaces
// its dead connection on its next ping (a pause in the stream of over a second), so
// none of its writes fails and it appends on. The follower must still get the stream
// exactly as the owner's client does, or be cut, never other bytes.
//
// Found on d9faf4b: the crash loses the last append (b); the next one appends c to a,
// and the follower, which had a and b, reads on from its offset in "a c": the middle of
// c, a torn event, then is cut at the end (its digest does not match the record).
func TestAttack16bCrashLostPartialNeverFeedsAFollowerOtherBytes(t *testing.T) {
	t.Parallel()
	const (
		a    = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"
		b    = "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n"
		c    = "data: {\"choices\":[{\"delta\":{\"content\":\"c, which is longer than b is\"}}]}\n\n"
		done = "data: [DONE]\n\n"
	)
	up := newPhased(a, b, c, done)
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pg, dsn, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	ctx := context.Background()
	// Only a durable commit flushes the WAL within the test's window (as in the ledger's
	// crash tests).
	for _, sql := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET autovacuum = off`, `SELECT pg_reload_conf()`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond)
	var urls []string
	for range 2 {
		gpool, err := connect.Postgres(ctx, dsn, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(gpool.Close)
		g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: gpool, Logger: testenv.Logger(t), Timeout: 30 * time.Second,
			Ledger: ledger.Config{Lease: time.Minute, StreamFlushInterval: 20 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		urls = append(urls, gs.URL+"/v1")
	}
	const key = "crash-lost-partial-0001"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 1); got != a {
		t.Fatalf("a: %q", got)
	}
	waitRow(t, pool, row, "a persisted", func(r *ledger.Row) bool { return r.Partial == a && r.Meta != nil })
	if _, err := pool.Exec(ctx, `CREATE TABLE durable_commit ()`); err != nil { // flushes the announcement and a
		t.Fatal(err)
	}
	follower := openStream(t, urls[1], key)
	fr := bufio.NewReader(follower.Body)
	if got := readEvents(t, fr, 1); got != a || follower.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("the follower's a: %q", got)
	}
	close(up.gates[0])
	if got := readEvents(t, or, 1); got != b {
		t.Fatalf("b: %q", got)
	}
	waitRow(t, pool, row, "b persisted", func(r *ledger.Row) bool { return r.Partial == a+b })
	if got := readEvents(t, fr, 1); got != b {
		t.Fatalf("the follower's b: %q", got)
	}
	pg.Kill()
	pg.Start()
	time.Sleep(1500 * time.Millisecond) // the model pauses; the pools ping their idle connections before the next use
	close(up.gates[1])
	if got := readEvents(t, or, 1); got != c {
		t.Fatalf("c: %q", got)
	}
	// Give the owner's persister time to write c (a correct one may refuse to).
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var p string
		if pool.QueryRow(ctx, `SELECT coalesce(partial, '') FROM llm_calls WHERE idem_key = $1`, row).Scan(&p) == nil && p != a && p != a+b {
			t.Logf("the row's partial after the crash and c: %q", p)
			break
		}
	}
	time.Sleep(500 * time.Millisecond) // the follower polls
	close(up.gates[2])
	if rest, err := readAllWithin(or, 15*time.Second); err != nil || rest != done {
		t.Fatalf("the owner's end: %q %v", rest, err)
	}
	rest, err := readAllWithin(fr, 15*time.Second)
	if rest != c+done && !(err != nil && strings.HasPrefix(c+done, rest)) {
		t.Fatalf("after a and b the follower got %q (err %v), want %q or a prefix of it and a cut: "+
			"the row's partial lost b to the crash and the owner appended c after a", rest, err, c+done)
	}
	if err != nil {
		t.Logf("the follower was cut after a correct prefix: %v", err)
	}
}

// streamGoroutines counts the goroutines of a stream's recording still running in the
// process (the persister, the recording, the upstream reader, the lease renewal).
func streamGoroutines() (int, string) {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	var found []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		for _, fn := range []string{"gateway.(*persister).run", "gateway.(*Gateway).recordStream", "gateway.readStream", "ledger.(*Attempt).renew"} {
			if strings.Contains(g, fn) {
				n++
				found = append(found, fn)
				break
			}
		}
	}
	return n, strings.Join(found, ", ")
}

// Gateway.Close right after streams ended every way (complete and recorded in the
// background, cut by the upstream, left by the client mid-stream and given up by Close)
// leaves no goroutine of theirs behind, and the one Close gave up is recorded as an
// ambiguous failure. Not parallel: it counts the process's goroutines.
func TestAttack16bCloseLeavesNoStreamGoroutines(t *testing.T) {
	complete := newPhased(gatedHead, gatedTail)
	ups := httptest.NewServer(complete)
	t.Cleanup(ups.Close)
	cut := &sseUpstream{script: func(int) ([]string, bool) { return []string{"data: {}\n\n"}, true }}
	cuts := httptest.NewServer(cut)
	t.Cleanup(cuts.Close)
	pool, _ := testenv.Postgres(t)
	mk := func(up string) (*gateway.Gateway, string) {
		g, err := gateway.New(gateway.Config{Upstream: up + "/v1", DB: pool, Logger: testenv.Logger(t), Registerer: prometheus.NewRegistry()})
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		return g, gs.URL + "/v1"
	}
	g, url := mk(ups.URL)
	gc, curl := mk(cuts.URL)
	// Left mid-stream by its client: the upstream holds the rest back.
	left := openStream(t, url, "close-goroutines-left")
	if got := readEvents(t, bufio.NewReader(left.Body), 2); got != gatedHead {
		t.Fatalf("head: %q", got)
	}
	<-complete.sent
	left.Body.Close()
	// Complete, recorded after the handler returned.
	if _, body, err := streamPost(t, url, "close-goroutines-done"); err != nil || body != gatedHead+gatedTail {
		t.Fatalf("a complete stream: %q %v", body, err)
	}
	if _, _, err := streamPost(t, curl, "close-goroutines-cut"); err == nil {
		t.Fatal("a cut stream ended cleanly")
	}
	if n, _ := streamGoroutines(); n == 0 {
		t.Fatal("no goroutine of the stream left by its client found: the count below proves nothing")
	}
	for _, gw := range []*gateway.Gateway{g, gc} {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		err := gw.Close(ctx)
		cancel()
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n, which := streamGoroutines()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines of streams still running after Close: %s", n, which)
		}
	}
	r, err := g.Ledger().Get(context.Background(), keyFor("Bearer sk", "close-goroutines-left"))
	if err != nil || r.State != ledger.StateInFlight || r.Owner != "" || r.Ambiguous != 1 {
		t.Fatalf("the stream Close gave up: %+v %v; want in_flight, released, ambiguous 1", r, err)
	}
}
