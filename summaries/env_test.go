package summaries_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/httpapi"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// API keys of the test tenants, as ONCEFLOW_API_KEYS would configure them.
const (
	keyAcme   = "acme-api-key-0123456789"
	keyGlobex = "globex-api-key-0123456789"
)

var testAPIKeys = map[string]string{keyAcme: "acme", keyGlobex: "globex"}

// newAPIServer serves the summaries routes on a real HTTP server, assembled the way
// package cli's buildAPI assembles them: bearer-key authentication, the idempotency
// middleware (for its statuses and metrics) and the single-round-trip accept. rdb is the
// server's own Redis client (hooks added to it count only the server's round trips).
func newAPIServer(t testing.TB, rdb *redis.Client, prefix string, db summaries.Row) *httptest.Server {
	t.Helper()
	log := testenv.Logger(t)
	store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix, ResultTTL: 24 * time.Hour, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idempotency.New(idempotency.Config{
		Store: store,
		Tenant: func(r *http.Request) (string, error) {
			if t, ok := httpapi.TenantFrom(r.Context()); ok {
				return t, nil
			}
			return "", idempotency.ErrUnauthenticated
		},
		StoreTimeout: 500 * time.Millisecond,
		Logger:       log,
	})
	if err != nil {
		t.Fatal(err)
	}
	api, err := summaries.NewAPI(summaries.APIConfig{
		Redis: rdb, DB: db, Keys: queue.Keys{Prefix: prefix, Queue: summaries.QueueName},
		Idempotency: mw, Store: store, Timeout: 500 * time.Millisecond, Logger: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := api.LoadScripts(context.Background()); err != nil {
		t.Fatal(err)
	}
	s := httpapi.New(httpapi.Config{Logger: log})
	api.Register(s, httpapi.NewAuthenticator(testAPIKeys))
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return srv
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

// newHandler returns the summaries job handler on pool with client as the model.
func newHandler(t testing.TB, pool *pgxpool.Pool, client llm.Client, cfg summaries.HandlerConfig) *summaries.Handler {
	t.Helper()
	cfg.DB, cfg.LLM = pool, client
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	h, err := summaries.NewHandler(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return h
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
