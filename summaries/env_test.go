package summaries_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/outbox/webhook"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

// API keys of the test tenants, as ONCEFLOW_API_KEYS would configure them.
const (
	keyAcme   = "acme-api-key-0123456789"
	keyGlobex = "globex-api-key-0123456789"
)

var testAPIKeys = map[string]string{keyAcme: "acme", keyGlobex: "globex"}

// newAPIServer serves the summaries routes on a real HTTP server, assembled the way
// package cli's appServer assembles them: an onceflow.Client with the summaries
// workflow, its routes authenticating by bearer key and answering the command's 401
// (the idempotency middleware for its statuses and metrics, the single-round-trip
// accept), mounted beside the health endpoints. rdb is the server's own Redis client
// (hooks added to it count only the server's round trips).
func newAPIServer(t testing.TB, rdb *redis.Client, prefix string, db *pgxpool.Pool) *httptest.Server {
	t.Helper()
	log := testenv.Logger(t)
	wf := summaries.Workflow(summaries.Options{Tenant: bearerTenant, Unauthorized: http.HandlerFunc(httpapi.Unauthorized),
		Timeout: 500 * time.Millisecond, Logger: log})
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Logger: log, Workflows: []onceflow.Workflow{wf}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.LoadScripts(context.Background()); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	if err := c.Mount(mux); err != nil {
		t.Fatal(err)
	}
	s := httpapi.New(httpapi.Config{Logger: log})
	s.Mount(mux)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return srv
}

// testAuth authenticates the test tenants' keys.
var testAuth = httpapi.NewAuthenticator(testAPIKeys)

// bearerTenant is the tenant of a request's bearer key, as package cli's Host.Tenant
// returns it.
func bearerTenant(r *http.Request) (string, error) {
	if t, ok := testAuth.Tenant(r); ok {
		return t, nil
	}
	return "", idempotency.ErrUnauthenticated
}

// reply is one HTTP answer.
type reply struct {
	code   int
	header http.Header
	body   string
}

// json decodes the body into a map.
func (r reply) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(r.body), &m); err != nil {
		t.Fatalf("body %q is not a JSON object: %v", r.body, err)
	}
	return m
}

// request describes one POST /v1/summaries.
type request struct {
	apiKey, idemKey, ctype, body string
	header                       map[string]string // extra headers
}

func do(t *testing.T, req *http.Request) reply {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header, string(b)}
}

func post(t *testing.T, base string, r request) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+"/v1/summaries", strings.NewReader(r.body))
	if err != nil {
		t.Fatal(err)
	}
	if r.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+r.apiKey)
	}
	if r.idemKey != "" {
		req.Header.Set("Idempotency-Key", r.idemKey)
	}
	if r.ctype != "" {
		req.Header.Set("Content-Type", r.ctype)
	}
	for k, v := range r.header {
		req.Header.Set(k, v)
	}
	return do(t, req)
}

func get(t *testing.T, base, apiKey, jobID string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+"/v1/summaries/"+jobID, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+apiKey)
	return do(t, req)
}

// validBody is a request body the route accepts.
func validBody(text string) string {
	b, _ := json.Marshal(summaries.Request{Text: text, Notify: "team@example.com"})
	return string(b)
}

// jobIDOf is the job id the API derives for tenant's key (UUIDv5 of the scope).
func jobIDOf(tenant, key string) string {
	return summaries.JobID(idempotency.Scope{Tenant: tenant, Method: http.MethodPost, Path: "/v1/summaries", Key: key})
}

// streamJobs returns the messages in the queue's stream, oldest first.
func streamJobs(t *testing.T, rdb *redis.Client, keys queue.Keys) []queue.Message {
	t.Helper()
	entries, err := rdb.XRange(context.Background(), keys.Stream(), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := make([]queue.Message, 0, len(entries))
	for _, e := range entries {
		m, err := queue.ParseMessage(e.Values)
		if err != nil {
			t.Fatalf("stream entry %s: %v", e.ID, err)
		}
		out = append(out, m)
	}
	return out
}

// handlerConfig is what a test sets of the summaries worker.
type handlerConfig struct {
	// Ledger, when set, runs the worker's model calls through the llm_calls ledger (the
	// Client's Config.Model) configured by LedgerConfig; without it the model is called
	// directly (Options.Unledgered).
	Ledger       *ledger.Ledger
	LedgerConfig ledger.Config
	// Breaker stops the direct model calls while it is open.
	Breaker  llm.Breaker
	Provider string
	Model    string
	Retry    retry.Policy
	Logger   *slog.Logger
	// Registerer receives the workflow's and the client's metrics.
	Registerer prometheus.Registerer
	// NoLimits turns the model's limiter off (Config.NoLimits).
	NoLimits bool
	// DurableAnswers records each model answer with a durable commit of its own
	// (Config.DurableAnswers).
	DurableAnswers bool
}

// testHandler runs summary jobs through an onceflow.Client with the summaries workflow
// (Inspector.Handler of the summaries queue), and reports each run's outcome.
type testHandler struct {
	h      queue.Handler
	client *onceflow.Client
}

type outcomeKey struct{}

// Handle implements queue.Handler.
func (h *testHandler) Handle(ctx context.Context, job *queue.Job) error {
	_, err := h.Process(ctx, job)
	return err
}

// Process runs job and returns the worker's outcome with its error.
func (h *testHandler) Process(ctx context.Context, job *queue.Job) (summaries.Outcome, error) {
	var o summaries.Outcome
	err := h.h.Handle(context.WithValue(ctx, outcomeKey{}, &o), job)
	return o, err
}

// newHandler returns the summaries job handler on pool with client as the model.
func newHandler(t testing.TB, pool *pgxpool.Pool, client llm.Client, cfg handlerConfig) *testHandler {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	rdb, err := onceflow.NewRedis(testenv.RedisURL(t)) // the handler does not use it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	o := summaries.Options{Model: cfg.Model, Logger: cfg.Logger, Registerer: cfg.Registerer,
		OnJob: func(ctx context.Context, _ string, outcome summaries.Outcome, _ error) {
			if p, ok := ctx.Value(outcomeKey{}).(*summaries.Outcome); ok {
				*p = outcome
			}
		}}
	cc := onceflow.Config{Redis: rdb, DB: pool, Logger: cfg.Logger, Registerer: cfg.Registerer, NoLimits: cfg.NoLimits, DurableAnswers: cfg.DurableAnswers}
	if cfg.Ledger != nil {
		cc.Model, cc.Provider, cc.ModelRetry, cc.Ledger = client, cfg.Provider, cfg.Retry, cfg.LedgerConfig
		cc.Ledger.Logger = cfg.Logger
	} else {
		o.Unledgered, o.Retry = client, cfg.Retry
		if cfg.Breaker != nil {
			o.Unledgered = llm.WithBreaker(client, cfg.Breaker)
		}
	}
	cc.Workflows = []onceflow.Workflow{summaries.Workflow(o)}
	c, err := onceflow.NewClient(cc)
	if err != nil {
		t.Fatal(err)
	}
	return &testHandler{h: c.Inspector().Handler(summaries.QueueName), client: c}
}

// startWorker runs a queue worker until the test ends (or the returned stop is called,
// which waits for Run to return).
func startWorker(t testing.TB, cfg queue.WorkerConfig) (stop func()) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	if cfg.Block == 0 {
		cfg.Block = 100 * time.Millisecond
	}
	w, err := queue.NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("worker: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// count runs a count(*) query.
func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// pipeline is one test's queue, database and email provider.
type pipeline struct {
	t    *testing.T
	rdb  *redis.Client
	keys queue.Keys
	pool *pgxpool.Pool
	dsn  string
	sink *webhooksink.Sink
	hook *httptest.Server // the sink's URL
}

func newPipeline(t *testing.T) *pipeline {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	return newPipelineOn(t, rdb, prefix)
}

// privateRedis starts a Redis of the test's own (one it may pause, stop, or point a
// process at) and returns it with a client.
func privateRedis(t *testing.T) (*testenv.Server, *redis.Client) {
	t.Helper()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return srv, rdb
}

// newPipelineOn is newPipeline on a Redis of the test's choosing.
func newPipelineOn(t *testing.T, rdb *redis.Client, prefix string) *pipeline {
	t.Helper()
	pool, dsn := testenv.Postgres(t)
	sink := webhooksink.New(webhooksink.Options{})
	hook := httptest.NewServer(sink)
	t.Cleanup(hook.Close)
	return &pipeline{t: t, rdb: rdb, keys: queue.Keys{Prefix: prefix, Queue: summaries.QueueName}, pool: pool, dsn: dsn, sink: sink, hook: hook}
}

// enqueue adds a job as the API would: the canonical request as payload.
func (p *pipeline) enqueue(jobID, text string) queue.Message {
	p.t.Helper()
	req := summaries.Request{Text: text, Notify: "owner@example.com"}
	m := queue.Message{JobID: jobID, Tenant: "acme", Payload: req.Canonical()}
	if _, err := queue.Enqueue(context.Background(), p.rdb, p.keys, m); err != nil {
		p.t.Fatal(err)
	}
	return m
}

// relay returns an outbox relay sending to the sink over HTTP with the webhook sender.
func (p *pipeline) relay(cfg outbox.Config) *outbox.Relay {
	p.t.Helper()
	sender, err := webhook.New(webhook.Config{URL: p.hook.URL})
	if err != nil {
		p.t.Fatal(err)
	}
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(p.t)
	}
	r, err := outbox.NewRelay(pgoutbox.New(p.pool), sender, cfg)
	if err != nil {
		p.t.Fatal(err)
	}
	return r
}

// pass runs one relay pass.
func (p *pipeline) pass(r *outbox.Relay) outbox.PassResult {
	p.t.Helper()
	res, err := r.Pass(context.Background())
	if err != nil {
		p.t.Fatalf("relay pass: %v", err)
	}
	return res
}

// effects checks the summaries and outbox rows of jobID and the emails delivered for it.
func (p *pipeline) effects(jobID string, summariesWant, outboxWant, emailsWant int) {
	p.t.Helper()
	s := count(p.t, p.pool, `SELECT count(*) FROM summaries WHERE job_id = $1`, jobID)
	o := count(p.t, p.pool, `SELECT count(*) FROM outbox WHERE dedupe_key = $1 AND topic = $2`, summaries.DedupeKey(jobID), summaries.TopicSummaryReady)
	e := p.sink.Count(summaries.DedupeKey(jobID))
	if s != summariesWant || o != outboxWant || e != emailsWant {
		p.t.Fatalf("job %s: %d summaries, %d outbox rows, %d emails; want %d, %d, %d", jobID, s, o, e, summariesWant, outboxWant, emailsWant)
	}
	if all := p.sink.Stats().Deliveries; all != emailsWant {
		p.t.Fatalf("%d emails delivered in all, want %d", all, emailsWant)
	}
}

// pending returns the group's pending entries.
func (p *pipeline) pending() []redis.XPendingExt {
	p.t.Helper()
	ps, err := p.rdb.XPendingExt(context.Background(), &redis.XPendingExtArgs{
		Stream: p.keys.Stream(), Group: queue.DefaultGroup, Start: "-", End: "+", Count: 100,
	}).Result()
	if err != nil && !strings.Contains(err.Error(), "NOGROUP") {
		p.t.Fatal(err)
	}
	return ps
}

// dead returns the dead letters of jobID.
func (p *pipeline) dead(jobID string) []queue.DeadLetter {
	p.t.Helper()
	d, err := queue.FindDead(context.Background(), p.rdb, p.keys, jobID)
	if err != nil {
		p.t.Fatal(err)
	}
	return d
}

// recorder is a queue.Handler running the summaries worker (testHandler) and recording each run.
type recorder struct {
	h    *testHandler
	mu   sync.Mutex
	runs []run
}

func (r *recorder) Handle(ctx context.Context, job *queue.Job) error {
	start := time.Now()
	o, err := r.h.Process(ctx, job)
	r.mu.Lock()
	r.runs = append(r.runs, run{o, err, job.Deliveries, start})
	r.mu.Unlock()
	return err
}

func (r *recorder) Runs() []run {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]run(nil), r.runs...)
}

// fastRetries keeps a delivery's four attempts quick: the fake's Retry-After (1s) is
// capped to a few milliseconds, as is the jitter.
var fastRetries = retry.Policy{Base: time.Millisecond, Cap: 5 * time.Millisecond, RetryAfterCap: 5 * time.Millisecond}

// process runs the handler on a job directly, as one delivery, to write its outbox row.
func (p *pipeline) process(m queue.Message) {
	p.t.Helper()
	h := newHandler(p.t, p.pool, fake.New(), handlerConfig{})
	if o, err := h.Process(context.Background(), &queue.Job{Message: m, ID: "1-1", Deliveries: 1}); err != nil || o != summaries.OutcomeDone {
		p.t.Fatalf("process: %v %v", o, err)
	}
}

// exampleStores gives a runnable example the test Redis (ONCEFLOW_REDIS_URL) with a key
// prefix of its own and a pool on a migrated PostgreSQL schema of its own
// (ONCEFLOW_DATABASE_URL); done removes both. It discards slog's default logger.
func exampleStores() (rdb *redis.Client, prefix string, db *pgxpool.Pool, done func()) {
	slog.SetDefault(slog.New(slog.DiscardHandler))
	t := testenv.NewExampleT()
	rdb, prefix = testenv.Redis(t)
	db, _ = testenv.Postgres(t)
	return rdb, prefix, db, t.Done
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}

func lgSetup(t *testing.T) *lgEnv {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	fake, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	gate := &lgGate{next: fake, arrived: make(chan struct{}, 1), release: make(chan struct{})}
	srv := httptest.NewServer(gate)
	t.Cleanup(func() { gate.Release(); fake.Close(); srv.Close() })
	l, err := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t), Wait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return &lgEnv{rdb: rdb, keys: queue.Keys{Prefix: prefix, Queue: summaries.QueueName}, pool: pool, fake: fake, gate: gate,
		model: openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "sk-test"}), ledger: l}
}

// countedAPIServer starts the API on a Redis client of its own whose round trips rt
// counts, on the test's own key prefix and PostgreSQL schema, and returns a client to
// inspect its keys, the queue's keys, rt and the API's URL.
func countedAPIServer(t *testing.T) (inspect *redis.Client, keys queue.Keys, rt *roundtrip.Counter, base string) {
	t.Helper()
	inspect, prefix := testenv.Redis(t)
	keys = queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	serverRedis, err := connect.Redis(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { serverRedis.Close() })
	rt = &roundtrip.Counter{}
	serverRedis.AddHook(rt)
	pool, _ := testenv.Postgres(t)
	return inspect, keys, rt, newAPIServer(t, serverRedis, prefix, pool).URL
}
