// Package gateway is `onceflow gateway`: an OpenAI-compatible reverse proxy that gives
// any upstream (a provider, a self-hosted model server) server-side Idempotency-Key
// semantics, through the ledger table (docs/providers.md, "Running onceflow gateway").
//
// A POST carrying Idempotency-Key is recorded in llm_calls before it is forwarded:
//
//   - the first request is forwarded; its 2xx answer is recorded (the raw bytes, the
//     status and the headers) and returned;
//   - a repeat of a recorded key gets the recorded answer byte for byte, with
//     Idempotent-Replayed: true, and the upstream is not called;
//   - a repeat while the first is in flight joins it (join.go): it waits for the answer
//     and gets the same bytes (Onceflow-Joined: true); for a stream, the bytes so far at
//     once, then the live tail; on any gateway process (a call another process makes
//     is followed through its row, whose owner announces the stream's headers and
//     persists its output in batches). Past Config.JoinTimeout without an answer
//     begun, it gets 409 with Retry-After and retry-after-ms. When the call it follows
//     fails, a joiner that sent nothing yet begins again (one of them makes the next
//     attempt, the others join it); one that passed part of a stream on is cut;
//   - a repeat with another body (or on another path) gets 422, with x-should-retry:
//     false, as every error of the request itself (400, 404, 413) does, so that the
//     official SDKs do not retry what cannot succeed;
//   - the upstream call is not cancelled when the client disconnects: it completes and
//     is recorded, so the client's retry gets the replay, not a second generation;
//   - streams (text/event-stream) are passed on as they arrive, parsed as server-sent
//     events (llm/sse), persisted on the row in batches cut at event boundaries,
//     recorded once complete (the connection closed cleanly after a final event:
//     [DONE], message_stop, response.completed), and replayed whole, byte for byte;
//   - an upstream error answer is passed on and not recorded (a retry is a new
//     attempt); a timeout or a dropped connection leaves the row in_flight, counted as
//     ambiguous; a malformed answer is a clear 502 and a failed row. A gateway that
//     dies mid-call leaves a row whose lease runs out (ONCEFLOW_LEDGER_LEASE), and the
//     next retry takes it over: no row stays in_flight for ever. A stream cannot be
//     continued by another generation, so the take-over starts over: a new upstream
//     call whose answer carries Onceflow-Stream-Restarted (the bytes the dead attempt
//     had streamed); requests that followed the dead attempt's stream are cut. The
//     first answer recorded wins.
//
// Keys are scoped by every credential the request carries: the Authorization, x-api-key
// (Anthropic) and api-key (Azure OpenAI) headers, and any in Config.CredentialHeaders,
// hashed (SHA-256) so that no credential is stored (CredentialScope, KeyFor). Callers
// never share replays, and a request without any credential header has a scope of its
// own, so it is never answered from a replay recorded for one that had a credential.
// The headers are forwarded to the upstream unchanged; the upstream gets the scoped key
// (KeyFor) as its Idempotency-Key. Only POSTs to the model endpoints (chat/completions,
// completions, responses, messages) are recorded; requests without a key, every other
// path and every method but POST pass through untouched and unrecorded (bodies still
// size-limited). The gateway has no API keys of its own.
package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/http/httpguts"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
)

// Provider labels the gateway's ledger rows and metrics.
const Provider = "gateway"

// Defaults of Config's fields.
const (
	DefaultTimeout          = 5 * time.Minute
	DefaultMaxBodyBytes     = 8 << 20
	DefaultMaxResponseBytes = 32 << 20
	DefaultRetryAfter       = time.Second
	DefaultDeriveWindow     = 15 * time.Minute
	DefaultMaxIdleConns     = 256
)

// Config configures a Gateway.
type Config struct {
	// Upstream is the API root requests are forwarded to, /v1 included
	// (ONCEFLOW_LLM_BASE_URL): /v1/chat/completions on the gateway goes to
	// Upstream + "/chat/completions". Required.
	Upstream string
	// DB holds the llm_calls table. Required.
	DB ledger.DB
	// Ledger configures the ledger (Lease, Retention, StreamFlushInterval, ...); its Wait
	// is forced to "never" (the gateway's join does the waiting), and Logger and
	// Registerer default to the gateway's.
	Ledger ledger.Config
	// Timeout bounds each upstream exchange, reading the answer included
	// (ONCEFLOW_GATEWAY_TIMEOUT). Default: 5m.
	Timeout time.Duration
	// MaxBodyBytes bounds a request body (ONCEFLOW_GATEWAY_MAX_BODY); larger ones get
	// 413. Default: 8 MiB.
	MaxBodyBytes int64
	// MaxResponseBytes bounds an answer the gateway records; a larger one is a 502 and
	// a failed row. Default: 32 MiB.
	MaxResponseBytes int64
	// JoinTimeout bounds how long a request whose key is in flight waits for the call
	// to answer (or, for a stream, to begin) before it gets 409
	// (ONCEFLOW_GATEWAY_JOIN_TIMEOUT). Default: Timeout. Negative: never wait (409 at
	// once).
	JoinTimeout time.Duration
	// RetryAfter is the Retry-After (and retry-after-ms) of a 409. Default: 1s.
	RetryAfter time.Duration
	// CredentialHeaders names request headers that carry credentials besides the
	// built-in DefaultCredentialHeaders, which always scope keys
	// (ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS): a self-hosted upstream's own key header, for
	// example. Each must be a valid header name; case does not matter. Default: none
	// (Authorization, x-api-key and api-key only).
	CredentialHeaders []string
	// Limiter, when set, admits every POST to a model endpoint (chat/completions,
	// completions, responses, messages), keyed or not, before it goes upstream, and
	// learns from its answer (limiter; docs/limits.md): the gateway then keeps all
	// its callers under the provider's limits, shares one pause with every process of
	// the fleet when the provider answers 429, and answers a call put off with 429,
	// Retry-After and retry-after-ms. Callers are the limiter's tenants, one per
	// TenantHeader value. Replays and joins are never
	// admitted: they make no upstream call. Default: nil, no admission.
	Limiter *limiter.Limiter
	// TenantHeader names the request header whose (first) value identifies a caller to
	// the Limiter: its tenant is "cred-" and 16 hex digits of a SHA-256 of it. It should
	// be the header the upstream authenticates with, so that a caller cannot become a
	// new tenant by adding a header the upstream ignores
	// (ONCEFLOW_GATEWAY_TENANT_HEADER). Default: by protocol: x-api-key on
	// /v1/messages (Anthropic), else Authorization, or api-key (Azure OpenAI) when a
	// request has no Authorization.
	TenantHeader string
	// DeriveKeys, set to DeriveRetryCount, gives requests without an Idempotency-Key
	// that the official SDKs send (they carry X-Stainless-Retry-Count) a key of the
	// gateway's own, so that the SDK's automatic retries are answered from the first
	// attempt's call (ONCEFLOW_GATEWAY_DERIVE_KEYS=retry-count; see derive.go and
	// docs/providers.md for what it can and cannot tell). Default: "", off.
	DeriveKeys string
	// DeriveWindow is how long after a first attempt its retries are recognised
	// (ONCEFLOW_GATEWAY_DERIVE_WINDOW). Default: 15m, above the SDKs' 10-minute
	// default timeout.
	DeriveWindow time.Duration
	// Transport sends upstream requests. Default: a clone of http.DefaultTransport
	// keeping up to DefaultMaxIdleConns idle connections to the upstream.
	Transport http.RoundTripper
	// Logger receives the gateway's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer exports the gateway's and its ledger's metrics; nil: unexported.
	Registerer prometheus.Registerer
}

// DefaultCredentialHeaders are the request headers that always scope keys, canonical:
// Authorization (OpenAI and most others), x-api-key (Anthropic) and api-key (Azure
// OpenAI). Config.CredentialHeaders adds to them. The variable is a copy for reading:
// the gateway scopes keys by a list of its own, which changing it does not change (so
// no code in the process can make two callers' credentials share keys).
var DefaultCredentialHeaders = slices.Clone(builtinCredentialHeaders)

// builtinCredentialHeaders are the headers that always scope keys
// (DefaultCredentialHeaders is a copy).
var builtinCredentialHeaders = []string{"Authorization", "X-Api-Key", "Api-Key"}

// Gateway is the proxy, an http.Handler for the /v1/ paths. It is safe for concurrent
// use.
type Gateway struct {
	cfg         Config
	credentials []string // canonical, sorted, without duplicates
	upstream    *url.URL
	ledger      *ledger.Ledger
	client      *http.Client
	proxy       *httputil.ReverseProxy
	log         *slog.Logger
	requests    *prometheus.CounterVec
	joining     prometheus.Gauge

	// base is cancelled by Close: it ends the upstream calls a shutdown gives up.
	base    context.Context
	stop    context.CancelFunc
	calls   sync.WaitGroup // keyed requests in flight
	flights flights        // the keyed calls this process makes, for requests that join them
}

// Results of a request, the label of onceflow_gateway_requests_total.
const (
	resultPassthrough   = "passthrough"
	resultForwarded     = "forwarded"
	resultReplayed      = "replayed"
	resultInFlight      = "in_flight"
	resultJoined        = "joined"
	resultLimited       = "limited"
	resultKeyReused     = "key_reused"
	resultBadRequest    = "bad_request"
	resultUpstreamError = "upstream_error"
	resultUnavailable   = "ledger_unavailable"
)

// New checks cfg and returns the Gateway.
func New(cfg Config) (*Gateway, error) {
	u, err := url.Parse(cfg.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, errors.New("gateway: Upstream must be an http or https URL")
	}
	if cfg.DB == nil {
		return nil, errors.New("gateway: DB is required")
	}
	credentials, err := credentialHeaders(cfg.CredentialHeaders)
	if err != nil {
		return nil, err
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxResponseBytes <= 0 {
		cfg.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if cfg.RetryAfter <= 0 {
		cfg.RetryAfter = DefaultRetryAfter
	}
	switch cfg.DeriveKeys {
	case "", DeriveRetryCount:
	default:
		return nil, fmt.Errorf("gateway: DeriveKeys %q: want %q or nothing", cfg.DeriveKeys, DeriveRetryCount)
	}
	if cfg.DeriveWindow <= 0 {
		cfg.DeriveWindow = DefaultDeriveWindow
	}
	if cfg.TenantHeader != "" && !httpguts.ValidHeaderFieldName(cfg.TenantHeader) {
		return nil, fmt.Errorf("gateway: TenantHeader: %q is not a valid header name", cfg.TenantHeader)
	}
	cfg.TenantHeader = http.CanonicalHeaderKey(cfg.TenantHeader)
	if cfg.JoinTimeout == 0 {
		cfg.JoinTimeout = cfg.Timeout
	}
	if cfg.Transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		// One upstream host, many callers: keep a connection per call in flight
		// instead of net/http's 2 idle per host, or every call beyond two dials anew.
		t.MaxIdleConnsPerHost = DefaultMaxIdleConns
		t.MaxIdleConns = DefaultMaxIdleConns
		cfg.Transport = t
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	lc := cfg.Ledger
	lc.Wait = -1
	if lc.Logger == nil {
		lc.Logger = cfg.Logger
	}
	if lc.Registerer == nil {
		lc.Registerer = cfg.Registerer
	}
	l, err := ledger.New(cfg.DB, lc)
	if err != nil {
		return nil, err
	}
	l.InitMetrics(Provider)
	base, stop := context.WithCancel(context.Background())
	g := &Gateway{
		base: base, stop: stop,
		cfg: cfg, credentials: credentials, upstream: u, ledger: l, log: cfg.Logger,
		client: &http.Client{Transport: cfg.Transport, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		requests: metrics.Register(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "gateway", Name: "requests_total",
			Help: "Requests through onceflow gateway by result: passthrough (no key), forwarded, replayed, joined (answered by a call in flight), limited (429 from the limiter), in_flight (409 after the join timeout), key_reused (422), bad_request, upstream_error, ledger_unavailable.",
		}, []string{"result"})),
	}
	g.joining = metrics.Register(cfg.Registerer, prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "gateway", Name: "joining",
		Help: "Requests waiting for, or passing on, a keyed call in flight that another request makes.",
	}))
	metrics.Init(g.requests, []string{resultPassthrough, resultForwarded, resultReplayed, resultJoined, resultLimited, resultInFlight, resultKeyReused,
		resultBadRequest, resultUpstreamError, resultUnavailable})
	g.proxy = &httputil.ReverseProxy{
		Transport: cfg.Transport,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL = g.target(pr.In)
			pr.Out.Host = ""
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if sw, ok := r.Context().Value(permitKey{}).(*statusWriter); ok {
				sw.proxyFailed = err // the call got no answer: settle it as such
			}
			var mb *http.MaxBytesError
			switch {
			case errors.As(err, &mb):
				writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", fmt.Sprintf("request body exceeds %d bytes", cfg.MaxBodyBytes))
			case errors.Is(err, os.ErrDeadlineExceeded): // the client's body missed the server's read deadline
				writeError(w, http.StatusRequestTimeout, "invalid_request_error", "request_timeout", "the request body was not received in time")
			case errors.Is(err, context.DeadlineExceeded):
				writeError(w, http.StatusGatewayTimeout, "upstream_error", "upstream_timeout", "the upstream did not answer in time")
			default:
				g.log.WarnContext(r.Context(), "gateway: pass-through request failed", "path", r.URL.Path, "err", withoutQuery(err))
				writeError(w, http.StatusBadGateway, "upstream_error", "upstream_unreachable", "the upstream could not be reached")
			}
		},
	}
	return g, nil
}

// Close ends the keyed upstream calls still in flight, which a shutdown is giving up:
// each is recorded as an ambiguous failure, so that a retry sent to another gateway
// takes the call over at once instead of getting 409 until the dead owner's lease runs
// out. It waits for them to be recorded, until ctx is done. Call it once the HTTP
// server stopped waiting for its handlers; requests after Close fail at once.
func (g *Gateway) Close(ctx context.Context) error {
	g.stop()
	done := make(chan struct{})
	go func() { g.calls.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("gateway: close: calls still being recorded: %w", ctx.Err())
	}
}

// ErrNotMigrated is what Ready reports when a table the gateway writes does not exist:
// the database was not migrated (`onceflow migrate`).
var ErrNotMigrated = errors.New("gateway: the database is not migrated: run `onceflow migrate`")

// readySQL finds the tables the gateway writes, by the connection's search_path.
const readySQL = `SELECT to_regclass('llm_calls') IS NOT NULL, to_regclass('gateway_derived_keys') IS NOT NULL`

// Ready reports whether the gateway can record calls: PostgreSQL answers, and the
// tables it writes exist (llm_calls, and gateway_derived_keys with DeriveKeys); an
// error matching ErrNotMigrated names the missing table. `onceflow gateway` serves it
// as /readyz's "ledger" check, so that a gateway on a database nobody migrated takes
// no traffic: every keyed request would fail on it, with nothing a retry can mend.
func (g *Gateway) Ready(ctx context.Context) error {
	var calls, derived bool
	if err := g.cfg.DB.QueryRow(ctx, readySQL).Scan(&calls, &derived); err != nil {
		return fmt.Errorf("gateway: ledger: %w", err)
	}
	switch {
	case !calls:
		return fmt.Errorf("%w (no table llm_calls)", ErrNotMigrated)
	case !derived && g.cfg.DeriveKeys != "":
		return fmt.Errorf("%w (no table gateway_derived_keys)", ErrNotMigrated)
	}
	return nil
}

// Ledger returns the gateway's ledger (Run runs its purge loop).
func (g *Gateway) Ledger() *ledger.Ledger { return g.ledger }

// dotSegment reports whether the (unescaped) path p has a "." or ".." segment.
func dotSegment(p string) bool {
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "." || seg == ".." {
			return true
		}
	}
	return false
}

// target maps a request on the gateway (/v1/...) to the upstream URL.
func (g *Gateway) target(r *http.Request) *url.URL {
	u := *g.upstream
	rest := strings.TrimPrefix(r.URL.Path, "/v1")
	u.Path = strings.TrimSuffix(u.Path, "/") + rest
	u.RawPath = ""
	// The upstream's own query (Azure's api-version) is kept, the caller's added after it.
	switch {
	case u.RawQuery == "":
		u.RawQuery = r.URL.RawQuery
	case r.URL.RawQuery != "":
		u.RawQuery += "&" + r.URL.RawQuery
	}
	return &u
}

// ServeHTTP implements http.Handler for /v1/ paths.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1" && !strings.HasPrefix(r.URL.Path, "/v1/") {
		writeError(w, http.StatusNotFound, "invalid_request_error", "unknown_url", "onceflow gateway serves /v1/ paths only")
		return
	}
	if dotSegment(r.URL.Path) {
		// An escaped "..", which net/http's mux does not clean, would leave the
		// upstream's path (ONCEFLOW_LLM_BASE_URL) for another route of its host.
		g.requests.WithLabelValues(resultBadRequest).Inc()
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_path", "the path must not contain . or .. segments")
		return
	}
	if r.ContentLength > g.cfg.MaxBodyBytes { // refuse before forwarding anything
		g.requests.WithLabelValues(resultBadRequest).Inc()
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", fmt.Sprintf("request body exceeds %d bytes", g.cfg.MaxBodyBytes))
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes)
	if g.cfg.DeriveKeys == DeriveRetryCount && r.Method == http.MethodPost && len(r.Header.Values(idempotency.HeaderKey)) == 0 &&
		len(r.Header.Values(HeaderRetryCount)) > 0 && modelEndpoint(r.URL.Path) {
		g.derived(w, r)
		return
	}
	if r.Method != http.MethodPost || len(r.Header.Values(idempotency.HeaderKey)) == 0 || !modelEndpoint(r.URL.Path) {
		g.passThrough(w, r)
		return
	}
	g.keyed(w, r)
}

// credentialHeaders returns DefaultCredentialHeaders and extra, canonical, sorted and
// without duplicates, or an error naming an invalid header name.
func credentialHeaders(extra []string) ([]string, error) {
	names := slices.Clone(builtinCredentialHeaders)
	for _, n := range extra {
		if !httpguts.ValidHeaderFieldName(n) {
			return nil, fmt.Errorf("gateway: CredentialHeaders: %q is not a valid header name", n)
		}
		names = append(names, http.CanonicalHeaderKey(n))
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

// Scope is what a request's Idempotency-Key is unique within: a digest of the
// credential headers it carries. The zero Scope is that of a request carrying none,
// and no request carrying one has it.
type Scope struct {
	digest string // hex SHA-256 of the credentials' encoding; "" for none
}

// CredentialScope returns the Scope of the request headers h: every value of every
// header among DefaultCredentialHeaders and extra that h carries (an empty value
// counts). Names are canonicalised and sorted, and each name, its number of values and
// each value are length-prefixed before hashing, so two different sets of credentials
// never share a Scope; the order of the values of one header is kept. It returns the
// zero Scope when h carries none of the headers.
func CredentialScope(h http.Header, extra ...string) Scope {
	names := slices.Clone(builtinCredentialHeaders)
	for _, n := range extra {
		names = append(names, http.CanonicalHeaderKey(n))
	}
	slices.Sort(names)
	return scopeOf(h, slices.Compact(names))
}

// scopeOf is CredentialScope with names canonical, sorted and without duplicates.
func scopeOf(h http.Header, names []string) Scope {
	hash := sha256.New()
	found := false
	writeField(hash, "onceflow.gateway.credentials.v1")
	for _, name := range names {
		vs := h.Values(name)
		if len(vs) == 0 {
			continue
		}
		found = true
		writeField(hash, name)
		writeField(hash, strconv.Itoa(len(vs)))
		for _, v := range vs {
			writeField(hash, v)
		}
	}
	if !found {
		return Scope{}
	}
	return Scope{digest: hex.EncodeToString(hash.Sum(nil))}
}

// writeField writes p to w preceded by its length, so that a sequence of fields has
// one encoding.
func writeField(w io.Writer, p string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(p)))
	_, _ = w.Write(n[:])
	_, _ = io.WriteString(w, p)
}

// KeyFor returns the llm_calls key of an Idempotency-Key within scope (CredentialScope
// of the request's headers): "gw-" and 64 hex characters. It is also the key the
// upstream receives. Neither the credentials nor the key can be recovered from it, and
// a request without credentials (the zero Scope) never has the key of one with them.
func KeyFor(scope Scope, idempotencyKey string) string {
	h := sha256.New()
	kind := "none"
	if scope.digest != "" {
		kind = "credentials"
	}
	for _, p := range []string{"onceflow.gateway.v2", kind, scope.digest, idempotencyKey} {
		writeField(h, p)
	}
	return "gw-" + hex.EncodeToString(h.Sum(nil))
}

// requestHash is the fingerprint of a keyed request: method, path and query, and the
// body (canonical JSON when it is JSON, so key order and whitespace do not matter).
func requestHash(r *http.Request, body []byte) string {
	canon := body
	if c, err := idempotency.CanonicalJSON(body); err == nil {
		canon = c
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%s\n%s\n", r.Method, r.URL.Path, r.URL.RawQuery)
	h.Write(canon)
	return hex.EncodeToString(h.Sum(nil))
}

// modelOf reads the "model" field of a JSON body, for labels.
func modelOf(body []byte) string {
	var m struct {
		Model string `json:"model"`
	}
	_ = json.Unmarshal(body, &m) // invalid UTF-8 becomes U+FFFD
	r := []rune(m.Model)
	if len(r) > 64 {
		r = r[:64]
	}
	return string(r)
}

// keyed serves a POST with an Idempotency-Key through the ledger.
func (g *Gateway) keyed(w http.ResponseWriter, r *http.Request) {
	key, err := idempotency.KeyFromRequest(r.Header)
	if err != nil {
		g.requests.WithLabelValues(resultBadRequest).Inc()
		var ke *idempotency.KeyError
		detail := "invalid Idempotency-Key"
		if errors.As(err, &ke) {
			detail = ke.Detail
		}
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_idempotency_key", detail)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		g.bodyError(w, err)
		return
	}
	g.record(w, r, KeyFor(scopeOf(r.Header, g.credentials), key), requestHash(r, body), body)
}

// record serves a request through the ledger under the llm_calls key key: replayed,
// joined, or forwarded and recorded.
func (g *Gateway) record(w http.ResponseWriter, r *http.Request, key, hash string, body []byte) {
	call := ledger.Call{
		Key:         key,
		Work:        r.Method + " " + r.URL.Path,
		RequestHash: hash,
		Provider:    Provider,
		Model:       modelOf(body),
		Tenant:      g.tenantOf(r),
	}
	// The upstream call outlives the client: everything from here runs on a context
	// that the client's disconnect does not cancel, bounded by the upstream timeout.
	g.calls.Add(1)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), g.cfg.Timeout)
	stopAfter := context.AfterFunc(g.base, cancel) // Close ends it too
	release := func() {
		stopAfter()
		cancel()
		g.calls.Done()
	}
	// rest is what remains of the call after the handler returns (a stream passed on
	// whole, being recorded): it runs on a goroutine of its own, which then releases.
	var rest func()
	defer func() {
		if rest == nil {
			release()
			return
		}
		go func() {
			defer release()
			rest()
		}()
	}()
	for {
		att, rec, err := g.ledger.Begin(ctx, call)
		switch {
		case errors.Is(err, ledger.ErrInFlight):
			switch g.join(r.Context(), w, call.Key, call.RequestHash) {
			case joinBegin:
				continue
			case joinTimeout:
				g.requests.WithLabelValues(resultInFlight).Inc()
				retryAfter(w, g.cfg.RetryAfter)
				writeError(w, http.StatusConflict, "invalid_request_error", "idempotency_key_in_use", "a request with this Idempotency-Key is still in progress; retry later")
			}
			return
		case errors.Is(err, ledger.ErrKeyReused):
			g.requests.WithLabelValues(resultKeyReused).Inc()
			writeError(w, http.StatusUnprocessableEntity, "invalid_request_error", "idempotency_key_reused", "this Idempotency-Key was used with another request body or path")
			return
		case err != nil:
			g.ledgerUnavailable(r.Context(), w, "gateway: ledger unavailable", err)
			return
		case rec != nil:
			g.requests.WithLabelValues(resultReplayed).Inc()
			replay(w, rec)
			return
		}
		f := newFlight(att.Number(), call.RequestHash)
		g.flights.add(call.Key, f)
		// end ends the flight (as cut, unless forward ended it otherwise) and settles
		// the limiter's permit (as sent and ambiguous, unless settled: a panic mid-call).
		end := func() {
			f.permit.Done(limiter.Result{Sent: true, Ambiguous: true})
			g.flights.remove(call.Key, f)
			f.finish(flightCut, nil, nil)
		}
		p, refused := g.admit(ctx, r, call.Key, body)
		if refused != nil {
			// Nothing went upstream: the row is free for the next attempt, and the
			// requests that joined this one get the same answer.
			g.fail(ctx, att, errLimiterNotSent, false)
			f.finish(flightAnswered, nil, refused)
			end()
			refused.write(w)
			return
		}
		f.permit = p
		defer func() { // also when forward panics (a cut stream aborts the handler)
			if rest == nil {
				end()
			}
		}()
		if tail := g.forward(ctx, w, r, att, f, body); tail != nil {
			rest = func() { defer end(); tail() }
		}
		return
	}
}

// ledgerUnavailable answers a request that PostgreSQL failed: 503 with Retry-After and
// retry-after-ms (nothing is forwarded unrecorded), logging msg.
func (g *Gateway) ledgerUnavailable(ctx context.Context, w http.ResponseWriter, msg string, err error) {
	g.requests.WithLabelValues(resultUnavailable).Inc()
	g.log.ErrorContext(ctx, msg, "err", err)
	retryAfter(w, time.Second)
	writeError(w, http.StatusServiceUnavailable, "server_error", "ledger_unavailable", "the idempotency ledger is unavailable; retry later")
}

// bodyError answers a request whose body could not be read.
func (g *Gateway) bodyError(w http.ResponseWriter, err error) {
	g.requests.WithLabelValues(resultBadRequest).Inc()
	var mb *http.MaxBytesError
	switch {
	case errors.As(err, &mb):
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", fmt.Sprintf("request body exceeds %d bytes", g.cfg.MaxBodyBytes))
	case errors.Is(err, os.ErrDeadlineExceeded): // the server's read deadline
		writeError(w, http.StatusRequestTimeout, "invalid_request_error", "request_timeout", "the request body was not received in time")
	default:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "unreadable_body", "the request body could not be read")
	}
}

// meta is what a replay needs besides the body: the status and the response headers.
type meta struct {
	Status int         `json:"status"`
	Header http.Header `json:"header"`
}

// recordedHeader reports whether a response header is recorded for replays: not the
// hop-by-hop ones, not those that describe one transfer.
func recordedHeader(name string) bool {
	switch http.CanonicalHeaderKey(name) {
	case "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "Te", "Trailer", "Transfer-Encoding",
		"Upgrade", "Content-Length", "Content-Encoding", "Date", "Set-Cookie":
		return false
	}
	return true
}

func replay(w http.ResponseWriter, rec *ledger.Record) {
	var m meta
	if json.Unmarshal(rec.Meta, &m) != nil || m.Status == 0 {
		m.Status = http.StatusOK
	}
	for k, vs := range m.Header {
		if recordedHeader(k) {
			w.Header()[k] = vs
		}
	}
	w.Header().Set(idempotency.HeaderReplayed, "true")
	w.Header().Set("Content-Length", strconv.Itoa(len(rec.Raw)))
	w.WriteHeader(m.Status)
	_, _ = w.Write(rec.Raw)
}

// forward makes the upstream call of the attempt att and answers w. For a stream it
// may return what remains to do once the handler returned (Gateway.stream's rest).
func (g *Gateway) forward(ctx context.Context, w http.ResponseWriter, r *http.Request, att *ledger.Attempt, f *flight, body []byte) (rest func()) {
	// #nosec G704 -- the scheme and host are the configured upstream's (ONCEFLOW_LLM_BASE_URL); the caller chooses only the path below it.
	out, err := http.NewRequestWithContext(ctx, r.Method, g.target(r).String(), bytes.NewReader(body))
	if err != nil {
		f.permit.Done(limiter.Result{})
		g.fail(ctx, att, err, false)
		writeError(w, http.StatusBadRequest, "invalid_request_error", "bad_request", "the request cannot be forwarded")
		return
	}
	for k, vs := range r.Header {
		if recordedHeader(k) && k != "Accept-Encoding" { // the transport negotiates (and undoes) compression
			out.Header[k] = vs
		}
	}
	// The upstream gets the scoped key: an upstream that honours keys but scopes them
	// otherwise (or not at all) must not replay one caller's answer to another.
	out.Header.Set(idempotency.HeaderKey, att.Key())
	resp, err := g.client.Do(out) // #nosec G704 -- to the configured upstream, as above
	if err != nil {
		settleSent(f.permit, nil, nil, err)
		ambiguous := ledger.IsAmbiguous(err)
		g.fail(ctx, att, err, ambiguous)
		g.requests.WithLabelValues(resultUpstreamError).Inc()
		if errors.Is(err, context.DeadlineExceeded) {
			writeError(w, http.StatusGatewayTimeout, "upstream_error", "upstream_timeout", "the upstream did not answer in time; retry with the same key")
			return
		}
		writeError(w, http.StatusBadGateway, "upstream_error", "upstream_unreachable", "the upstream could not be reached; retry with the same key")
		return
	}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt == "text/event-stream" && resp.StatusCode >= 200 && resp.StatusCode <= 299 {
		return g.stream(ctx, w, att, f, resp) // which closes the body
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		g.passError(ctx, w, att, f, resp)
		return
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, g.cfg.MaxResponseBytes+1))
	if f.permit != nil { // the usage is read for the limiter only
		settleSent(f.permit, resp, usageOf(raw), err)
	}
	switch {
	case err != nil:
		g.fail(ctx, att, err, ledger.IsAmbiguous(err))
		g.requests.WithLabelValues(resultUpstreamError).Inc()
		if errors.Is(err, context.DeadlineExceeded) {
			writeError(w, http.StatusGatewayTimeout, "upstream_error", "upstream_timeout", "the upstream answer did not complete in time; retry with the same key")
			return
		}
		writeError(w, http.StatusBadGateway, "upstream_error", "upstream_dropped", "the upstream connection dropped mid-answer; retry with the same key")
		return
	case int64(len(raw)) > g.cfg.MaxResponseBytes:
		g.fail(ctx, att, fmt.Errorf("upstream answer exceeds %d bytes", g.cfg.MaxResponseBytes), false)
		g.requests.WithLabelValues(resultUpstreamError).Inc()
		writeError(w, http.StatusBadGateway, "upstream_error", "upstream_response_too_large", fmt.Sprintf("the upstream answer exceeds the %d bytes the gateway records", g.cfg.MaxResponseBytes))
		return
	case !json.Valid(raw):
		g.fail(ctx, att, errors.New("malformed upstream response: not JSON"), false)
		g.requests.WithLabelValues(resultUpstreamError).Inc()
		writeError(w, http.StatusBadGateway, "upstream_error", "upstream_malformed", "the upstream answered 2xx with a body that is not JSON")
		return
	}
	m := meta{Status: resp.StatusCode, Header: keptHeader(resp.Header)}
	mb, _ := json.Marshal(m)
	rec, err := g.succeed(ctx, att, ledger.Result{Response: raw, Raw: raw, Meta: mb})
	g.requests.WithLabelValues(resultForwarded).Inc()
	if err != nil {
		g.log.WarnContext(ctx, "gateway: could not record an answer; passing it on unrecorded (recorded later if PostgreSQL was unavailable)", "err", err)
		rec = &ledger.Record{Raw: raw, Meta: mb}
	}
	// The recorded answer (another attempt's, if one won): what every retry will get.
	f.finish(flightRecorded, rec, nil)
	writeRecorded(w, rec)
	return nil
}

// writeRecorded answers with a recorded response without the replay header (this
// request made the call).
func writeRecorded(w http.ResponseWriter, rec *ledger.Record) {
	var m meta
	if json.Unmarshal(rec.Meta, &m) != nil || m.Status == 0 {
		m.Status = http.StatusOK
	}
	for k, vs := range m.Header {
		w.Header()[k] = vs
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(rec.Raw)))
	w.WriteHeader(m.Status)
	_, _ = w.Write(rec.Raw)
}

func keptHeader(h http.Header) http.Header {
	out := http.Header{}
	for k, vs := range h {
		if recordedHeader(k) {
			out[k] = vs
		}
	}
	return out
}

// passError passes an upstream error answer on, unrecorded: the upstream said what
// happened, so the row is failed (502 and 504, which a proxy in front of the provider
// sends when it lost the call, are ambiguous) and a retry is a new attempt.
func (g *Gateway) passError(ctx context.Context, w http.ResponseWriter, att *ledger.Attempt, f *flight, resp *http.Response) {
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	settleSent(f.permit, resp, nil, nil)
	g.fail(ctx, att, fmt.Errorf("upstream answered HTTP %d", resp.StatusCode),
		resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusGatewayTimeout)
	g.requests.WithLabelValues(resultForwarded).Inc()
	if resp.Header.Get(headerShouldRetry) == "" {
		switch resp.StatusCode {
		case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound, http.StatusUnprocessableEntity:
			// The request or its credentials are wrong: a retry of it cannot succeed.
			resp.Header.Set(headerShouldRetry, "false")
		}
	}
	// Requests that joined this call get the same answer: the call was made once.
	f.finish(flightAnswered, nil, &answer{status: resp.StatusCode, header: keptHeader(resp.Header), body: raw})
	for k, vs := range resp.Header {
		if recordedHeader(k) {
			w.Header()[k] = vs
		}
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(raw)))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(raw)
}

// withoutQuery returns err without the query string of the URL net/http puts in its
// transport errors (*url.Error): a query may carry a credential (?key=), which must
// reach neither llm_calls.error nor the logs. Other errors are returned as they are.
func withoutQuery(err error) error {
	var ue *url.Error
	if !errors.As(err, &ue) {
		return err
	}
	u, perr := url.Parse(ue.URL)
	if perr != nil {
		return &url.Error{Op: ue.Op, URL: "(unparseable URL)", Err: ue.Err}
	}
	if u.RawQuery == "" && u.User == nil {
		return err
	}
	u.RawQuery, u.User = "", nil
	return &url.Error{Op: ue.Op, URL: u.String(), Err: ue.Err}
}

// succeed records an answer, trying again while PostgreSQL is unavailable (a restart
// drops the pool's connections) for up to succeedPatience: the write is idempotent (the
// first answer recorded wins), and an answer that arrived but is not recorded would be
// generated again by the next retry. Past that, it returns the error, and the answer
// is passed on unrecorded while recordLater goes on trying in the background.
func (g *Gateway) succeed(ctx context.Context, att *ledger.Attempt, res ledger.Result) (*ledger.Record, error) {
	pctx, cancel := context.WithTimeout(ctx, succeedPatience)
	defer cancel()
	rec, err := succeedUntil(pctx, att, res)
	if errors.Is(err, ledger.ErrUnavailable) {
		g.recordLater(ctx, att, res)
	}
	return rec, err
}

// succeedUntil calls att.Succeed until it works, fails otherwise than by PostgreSQL
// being unavailable, or ctx ends; it tries at least once (Succeed's own write outlives
// ctx, within the ledger's write timeout).
func succeedUntil(ctx context.Context, att *ledger.Attempt, res ledger.Result) (*ledger.Record, error) {
	wait := 50 * time.Millisecond
	for {
		rec, _, err := att.Succeed(ctx, res)
		if err == nil || !errors.Is(err, ledger.ErrUnavailable) {
			return rec, err
		}
		select {
		case <-ctx.Done(): // Close cancels the contexts of unary calls; a stream's record is detached from it
			return rec, err
		case <-time.After(wait):
		}
		wait = min(wait*2, succeedRetryMax)
	}
}

// recordLater goes on trying to record an answer that succeed could not record within
// succeedPatience (a PostgreSQL outage longer than that), for up to the gateway's
// Timeout or until Close: once PostgreSQL is back, the answer that was generated (and
// billed) is the one every retry of the key replays, instead of a second generation.
// Its owner's lease counts from PostgreSQL's start as well (package ledger), so the
// retries that arrive meanwhile wait for this record rather than take the call over.
func (g *Gateway) recordLater(ctx context.Context, att *ledger.Attempt, res ledger.Result) {
	g.calls.Add(1) // the caller holds one: Close waits for this one too
	go func() {
		defer g.calls.Done()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), g.cfg.Timeout)
		defer cancel()
		defer context.AfterFunc(g.base, cancel)()
		if _, err := succeedUntil(ctx, att, res); err != nil {
			g.log.ErrorContext(ctx, "gateway: gave up recording an answer passed on unrecorded; a retry of its key will call the upstream again", "key", att.Key(), "err", err)
			return
		}
		g.log.InfoContext(ctx, "gateway: recorded an answer passed on unrecorded during a PostgreSQL outage", "key", att.Key())
	}()
}

const (
	// succeedPatience bounds how long succeed tries to record an answer before it is
	// passed on unrecorded (and recorded later).
	succeedPatience = 15 * time.Second
	// succeedRetryMax is the longest wait between two tries to record an answer: the
	// record lands within it once PostgreSQL is back.
	succeedRetryMax = 500 * time.Millisecond
)

func (g *Gateway) fail(ctx context.Context, att *ledger.Attempt, cause error, ambiguous bool) {
	if err := att.Fail(ctx, withoutQuery(cause), ambiguous); err != nil {
		g.log.WarnContext(ctx, "gateway: could not record a failed attempt; its lease will run out", "err", err)
	}
}

// Headers that steer the official SDKs' retries (OpenAI's and Anthropic's, in Python,
// Node and Go, read them): x-should-retry overrides their choice by status, and
// retry-after-ms (before Retry-After) sets their wait.
const (
	headerShouldRetry  = "X-Should-Retry"
	headerRetryAfterMs = "Retry-After-Ms"
)

// retryAfter tells a client when a retry can succeed: Retry-After in whole seconds (at
// least 1) and retry-after-ms.
func retryAfter(w http.ResponseWriter, d time.Duration) {
	d = max(d, time.Millisecond)
	w.Header().Set("Retry-After", strconv.Itoa(int(max(d.Round(time.Second), time.Second)/time.Second)))
	w.Header().Set(headerRetryAfterMs, strconv.FormatInt(d.Milliseconds(), 10))
}

// writeError answers with the gateway's own error: OpenAI's error shape, which SDKs
// parse, plus onceflow's {"detail"}. An error that a retry of the same request cannot
// mend (400, 404, 413, 422: the request itself is wrong, or its key was used for
// another request) says x-should-retry: false, so that an SDK does not retry it.
func writeError(w http.ResponseWriter, status int, typ, code, message string) {
	switch status {
	case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		w.Header().Set(headerShouldRetry, "false")
	}
	b, _ := json.Marshal(map[string]any{
		"error":  map[string]any{"message": message, "type": typ, "code": code, "param": nil},
		"detail": message,
	})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
