package gateway_test

// The gateway tests' rigs: upstreams (fake-llm, scripted SSE streams, held answers),
// gateways on a test's own PostgreSQL schema (one, a fleet of processes sharing it, or
// one on a private PostgreSQL the test can stop), requests in every protocol, and
// readers of streams, ledger rows and metrics.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// upstream is fake-llm (llm/fakeserver, which ignores Idempotency-Key unless told
// otherwise) behind a recorder of the Authorization headers it receives.
type upstream struct {
	*fakeserver.Server
	mu    sync.Mutex
	auths []string
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.auths = append(u.auths, r.Header.Get("Authorization"))
	u.mu.Unlock()
	u.Server.ServeHTTP(w, r)
}

// sseUpstream is an upstream that answers every request with a scripted event stream:
// the n-th call (from 0) writes the chunks of script(n), flushing after each, then
// drops the connection if drop, else closes cleanly. It counts its calls.
type sseUpstream struct {
	script func(call int) (chunks []string, drop bool)
	mu     sync.Mutex
	calls  int
}

func (u *sseUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	n := u.calls
	u.calls++
	u.mu.Unlock()
	chunks, drop := u.script(n)
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	for _, c := range chunks {
		_, _ = io.WriteString(w, c)
		http.NewResponseController(w).Flush()
	}
	if drop {
		panic(http.ErrAbortHandler) // the connection closes without the chunked terminator
	}
}

func (u *sseUpstream) Calls() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls
}

// gatedStream is an upstream whose stream stops after its first events until release is
// closed, then sends the rest. It counts its calls.
type gatedStream struct {
	release chan struct{}
	sent    chan struct{} // closed once the first events are out
	mu      sync.Mutex
	calls   int
}

const (
	gatedHead = "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" second\"}}]}\n\n"
	gatedTail = "data: {\"choices\":[{\"delta\":{\"content\":\" third\"}}]}\n\ndata: [DONE]\n\n"
)

func newGatedStream() *gatedStream {
	return &gatedStream{release: make(chan struct{}), sent: make(chan struct{})}
}

func (u *gatedStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	u.calls++
	first := u.calls == 1
	u.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("X-Request-Id", "req-gated")
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, gatedHead)
	http.NewResponseController(w).Flush()
	if first {
		close(u.sent)
		<-u.release
	}
	_, _ = io.WriteString(w, gatedTail)
}

func (u *gatedStream) Calls() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls
}

// bigStream is an upstream whose first call sends one event, waits for release, then
// sends n more events of about 1 KiB each as fast as its client reads, and [DONE].
// Later calls send the whole stream at once. It counts its calls.
type bigStream struct {
	n       int
	release chan struct{}
	sent    chan struct{}
	calls   atomic.Int64
}

func newBigStream(n int) *bigStream {
	return &bigStream{n: n, release: make(chan struct{}), sent: make(chan struct{})}
}

const bigHead = "data: {\"choices\":[{\"delta\":{\"content\":\"head\"}}]}\n\n"

// bigEvent is the i-th event of a bigStream's body.
func bigEvent(i int) string {
	return fmt.Sprintf("data: {\"choices\":[{\"delta\":{\"content\":\"%04d %s\"}}]}\n\n", i%10000, strings.Repeat("x", 1000))
}

// whole is the stream a client must receive.
func (u *bigStream) whole() string {
	var b strings.Builder
	b.WriteString(bigHead)
	for i := range u.n {
		b.WriteString(bigEvent(i))
	}
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

func (u *bigStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	first := u.calls.Add(1) == 1
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, bigHead)
	http.NewResponseController(w).Flush()
	if first {
		close(u.sent)
		select {
		case <-u.release:
		case <-r.Context().Done():
			return
		}
	}
	bw := bufio.NewWriterSize(w, 64<<10)
	for i := range u.n {
		if _, err := io.WriteString(bw, bigEvent(i)); err != nil {
			return
		}
	}
	_, _ = io.WriteString(bw, "data: [DONE]\n\n")
	_ = bw.Flush()
}

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

// heldUnary is an upstream whose first call waits for release before it answers; later
// calls answer at once, each with a body of its own (so a second generation shows). It
// counts its calls.
type heldUnary struct {
	release  chan struct{}
	received chan struct{} // closed once the first call is in
	once     sync.Once
	calls    atomic.Int64
}

func newHeldUnary() *heldUnary {
	return &heldUnary{release: make(chan struct{}), received: make(chan struct{})}
}

// answer is the body of the n-th call.
func (u *heldUnary) answer(n int64) string {
	return `{"id":"chatcmpl-held-` + strings.Repeat("x", int(n)) + `","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"generation ` +
		strings.Repeat("I", int(n)) + `"}}]}`
}

func (u *heldUnary) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	n := u.calls.Add(1)
	if n == 1 {
		u.once.Do(func() { close(u.received) })
		select {
		case <-u.release:
		case <-r.Context().Done():
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, u.answer(n))
}

type env struct {
	up     *upstream
	gw     *gateway.Gateway
	url    string // the gateway's /v1
	ledger *ledger.Ledger
	reg    *prometheus.Registry
	db     ledger.DB
}

func setup(t *testing.T, fake fakeserver.Config, cfg gateway.Config) *env {
	t.Helper()
	fake.Logger = testenv.Logger(t)
	fs, err := fakeserver.New(fake)
	if err != nil {
		t.Fatal(err)
	}
	up := &upstream{Server: fs}
	ups := httptest.NewServer(up)
	t.Cleanup(func() { fs.Close(); ups.Close() })
	pool, _ := testenv.Postgres(t)
	reg := prometheus.NewRegistry()
	cfg.Logger, cfg.Registerer = testenv.Logger(t), reg
	g, url := serveGateway(t, ups.URL, pool, cfg)
	return &env{up: up, gw: g, url: url, ledger: g.Ledger(), reg: reg, db: pool}
}

// serveGateway starts a gateway of cfg in front of the upstream at upstreamURL (its
// root) on db, and returns it and its /v1 URL; a nil cfg.Logger is the test's.
func serveGateway(t *testing.T, upstreamURL string, db *pgxpool.Pool, cfg gateway.Config) (*gateway.Gateway, string) {
	t.Helper()
	cfg.Upstream, cfg.DB = upstreamURL+"/v1", db
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	return g, gs.URL + "/v1"
}

// fleet is n gateways sharing one llm_calls table, as the processes of a fleet do.
type fleet struct {
	urls []string // each gateway's /v1
	regs []*prometheus.Registry
	pool *pgxpool.Pool
}

// gatewaysOn starts n gateways in front of up, sharing one llm_calls table.
func gatewaysOn(t *testing.T, up http.Handler, n int, cfg gateway.Config) *fleet {
	t.Helper()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	fl := &fleet{pool: pool}
	for range n {
		c := cfg
		reg := prometheus.NewRegistry()
		c.Logger, c.Registerer = testenv.Logger(t), reg
		_, url := serveGateway(t, ups.URL, pool, c)
		fl.urls = append(fl.urls, url)
		fl.regs = append(fl.regs, reg)
	}
	return fl
}

// waitJoining waits until n requests are joining a call on gateway i.
func (fl *fleet) waitJoining(t *testing.T, i, n int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		families, err := fl.regs[i].Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() == "onceflow_gateway_joining" && int(f.GetMetric()[0].GetGauge().GetValue()) >= n {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("gateway %d: fewer than %d requests joined", i, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// privateFleet is two gateways, each with a pool of its own (as two processes have),
// on a PostgreSQL of the test's own that the test can restart.
func privateFleet(t *testing.T, up http.Handler, cfg gateway.Config) (*testenv.Server, []string) {
	t.Helper()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pg, dsn, _ := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	var urls []string
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		pool, err := connect.Postgres(ctx, dsn, nil)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		c := cfg
		c.Logger = testenv.Logger(t)
		_, url := serveGateway(t, ups.URL, pool, c)
		urls = append(urls, url)
	}
	return pg, urls
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
	cfg.Logger = testenv.Logger(t)
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	g, url := serveGateway(t, ups.URL, gpool, cfg)
	return pg, g, url, pool
}

// freezer is a TCP proxy in front of PostgreSQL that can hang: frozen, it passes no
// byte either way and holds new connections without connecting them, as a network
// partition, a paused VM or a stuck storage layer does (the server neither answers nor
// refuses).
type freezer struct {
	ln     net.Listener
	target string
	frozen atomic.Bool
	thawed chan struct{} // closed and remade at every thaw
	mu     sync.Mutex
	conns  []net.Conn
}

func newFreezer(t *testing.T, target string) *freezer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &freezer{ln: ln, target: target, thawed: make(chan struct{})}
	go f.accept()
	t.Cleanup(func() {
		f.thaw()
		_ = ln.Close()
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, c := range f.conns {
			_ = c.Close()
		}
	})
	return f
}

func (f *freezer) freeze() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.thawed = make(chan struct{})
	f.frozen.Store(true)
}

func (f *freezer) thaw() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.frozen.Swap(false) {
		close(f.thawed)
	}
}

// wait returns once the proxy is not frozen.
func (f *freezer) wait() {
	f.mu.Lock()
	ch, frozen := f.thawed, f.frozen.Load()
	f.mu.Unlock()
	if frozen {
		<-ch
	}
}

func (f *freezer) accept() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			f.wait()
			s, err := net.Dial("tcp", f.target)
			if err != nil {
				_ = c.Close()
				return
			}
			f.mu.Lock()
			f.conns = append(f.conns, c, s)
			f.mu.Unlock()
			go f.pipe(s, c)
			f.pipe(c, s)
		}()
	}
}

// pipe copies from src to dst, holding every chunk while frozen.
func (f *freezer) pipe(dst, src net.Conn) {
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			f.wait()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// loggedGateway serves a gateway in front of upstream and returns its /v1 URL, its
// database and its logs.
func loggedGateway(t *testing.T, upstream http.Handler) (string, *pgxpool.Pool, *testenv.SyncBuffer) {
	t.Helper()
	ups := httptest.NewServer(upstream)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	logs := &testenv.SyncBuffer{}
	_, url := serveGateway(t, ups.URL, pool, gateway.Config{Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("gateway logs:\n%s", logs)
		}
	})
	return url, pool, logs
}

const chatBody = `{"model":"gpt-4.1-mini","temperature":1,"messages":[{"role":"user","content":"Say one random word."}]}`

func post(t *testing.T, url, key, auth, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

const messagesBody = `{"model":"claude-sonnet-4-5","max_tokens":64,"temperature":1,"messages":[{"role":"user","content":"Say one random word."}]}`

// send posts body to url with the Idempotency-Key key and the headers h (nil: none
// but the key and Content-Type) and returns the answer.
func send(t *testing.T, url, key, body string, h http.Header) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	for k, vs := range h {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, b)
	}
	return resp, b
}

// header builds an http.Header of name-value pairs, names canonicalised as a server
// receives them.
func header(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

const streamBody = `{"model":"gpt-4.1-mini","stream":true,"messages":[{"role":"user","content":"Say one random word."}]}`

// streamPost sends a keyed streaming request with Authorization "Bearer sk" and reads
// the answer whole; err is the read error of a stream that was cut.
func streamPost(t *testing.T, url, key string) (resp *http.Response, body string, err error) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", strings.NewReader(streamBody))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

// openStream sends a keyed streaming request and returns the response, its body unread.
func openStream(t *testing.T, url, key string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", strings.NewReader(streamBody))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// reply is one answer read whole.
type reply struct {
	code   int
	header http.Header
	body   string
	err    error
}

// sendWithin posts body to url with the Idempotency-Key key (none when "") and
// Authorization "Bearer sk", and reads the answer whole, within timeout.
func sendWithin(url, key, body string, timeout time.Duration) reply {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{code: resp.StatusCode, header: resp.Header, body: string(b), err: err}
}

// isClear503 reports whether r is the gateway's 503 for an unavailable ledger, telling
// the SDKs to retry after a second: Retry-After, retry-after-ms, no x-should-retry: false.
func isClear503(r reply) bool {
	return r.err == nil && r.code == http.StatusServiceUnavailable && r.header.Get("Retry-After") == "1" &&
		r.header.Get("Retry-After-Ms") == "1000" && r.header.Get("X-Should-Retry") != "false"
}

// rawPost posts body to url with the given headers and returns the status, the
// Idempotent-Replayed header and the body.
func rawPost(t *testing.T, url, body string, h http.Header) (int, string, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	for k, vs := range h {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), b
}

// protocol is one of the APIs the gateway records: its path, a request body and the
// credential header its SDKs send.
type protocol struct {
	name, path, body string
	cred             func(h http.Header, secret string)
}

var protocols = []protocol{
	{"chat completions", "/chat/completions", `{"model":"gpt-4.1-mini","temperature":1,"messages":[{"role":"user","content":"Say one random word."}]%s}`,
		func(h http.Header, s string) { h.Set("Authorization", "Bearer "+s) }},
	{"responses", "/responses", `{"model":"gpt-4.1-mini","temperature":1,"input":"Say one random word."%s}`,
		func(h http.Header, s string) { h.Set("Authorization", "Bearer "+s) }},
	{"anthropic messages", "/messages", `{"model":"claude-sonnet-4-0","max_tokens":64,"temperature":1,"messages":[{"role":"user","content":"Say one random word."}]%s}`,
		func(h http.Header, s string) { h.Set("X-Api-Key", s); h.Set("Anthropic-Version", "2023-06-01") }},
}

type protoAnswer struct {
	status         int
	joined, replay string
	contentType    string
	body           []byte
	err            error
}

// protoPost sends p's body with Idempotency-Key key and secret in p's credential header.
func protoPost(url string, p protocol, stream bool, key, secret string) protoAnswer {
	return protoSend(url, p, stream, secret, http.Header{"Idempotency-Key": {key}})
}

// protoSend sends p's body (streaming or not) with secret in p's credential header (""
// for none) and the headers h.
func protoSend(url string, p protocol, stream bool, secret string, h http.Header) protoAnswer {
	extra := ""
	if stream {
		extra = `,"stream":true`
	}
	req, _ := http.NewRequest(http.MethodPost, url+p.path, strings.NewReader(strings.Replace(p.body, "%s", extra, 1)))
	req.Header.Set("Content-Type", "application/json")
	if secret != "" {
		p.cred(req.Header, secret)
	}
	for k, vs := range h {
		req.Header[k] = vs
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return protoAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return protoAnswer{resp.StatusCode, resp.Header.Get("Onceflow-Joined"), resp.Header.Get("Idempotent-Replayed"),
		resp.Header.Get("Content-Type"), b, err}
}

// waitUpstreamInFlight waits until fs has a request in flight.
func waitUpstreamInFlight(t *testing.T, fs *fakeserver.Server) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for fs.Stats().InFlight == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no request reached the upstream")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// readEvents reads n events ("data: ...\n\n") from r.
func readEvents(t *testing.T, r *bufio.Reader, n int) string {
	t.Helper()
	var b strings.Builder
	for n > 0 {
		line, err := r.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			t.Fatalf("after %q: %v", b.String(), err)
		}
		if line == "\n" {
			n--
		}
	}
	return b.String()
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

// readExactly reads len(want) bytes from r within d and reports what it read.
func readExactly(r io.Reader, n int, d time.Duration) (string, error) {
	return within(d, errors.New("timed out"), func() (string, error) {
		b := make([]byte, n)
		k, err := io.ReadFull(r, b)
		return string(b[:k]), err
	})
}

// keyFor is the gateway's key of an Idempotency-Key sent with the Authorization header
// auth.
func keyFor(auth, key string) string {
	return gateway.KeyFor(gateway.CredentialScope(http.Header{"Authorization": {auth}}), key)
}

// requestsWith reads onceflow_gateway_requests_total{result}.
func requestsWith(t *testing.T, reg *prometheus.Registry, result string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "onceflow_gateway_requests_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if m.GetLabel()[0].GetValue() == result {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
