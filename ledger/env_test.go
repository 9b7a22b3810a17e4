package ledger_test

// The ledger tests' environment: TestMain, ledgers on a test's own PostgreSQL schema,
// a PostgreSQL the test can crash, fake-llm, and readers of rows and metrics.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/migrations"
)

// exampleDSN is a migrated schema of this test binary's own, for the runnable examples
// (which cannot take a *testing.T); TestMain creates and drops it.
var exampleDSN string

func TestMain(m *testing.M) {
	base := os.Getenv("ONCEFLOW_DATABASE_URL")
	if base == "" {
		fmt.Fprintln(os.Stderr, "ONCEFLOW_DATABASE_URL is not set: run the tests with `make test`, which starts PostgreSQL and exports it")
		os.Exit(1)
	}
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "t_ex_" + hex.EncodeToString(b[:])
	admin, err := pgx.Connect(ctx, base)
	if err == nil {
		_, err = admin.Exec(ctx, "CREATE SCHEMA "+schema)
	}
	if err == nil {
		u, _ := url.Parse(base)
		q := u.Query()
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
		exampleDSN = u.String()
		_, err = migrations.Up(ctx, exampleDSN, slog.New(slog.DiscardHandler))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "example schema:", err)
		os.Exit(1)
	}
	code := m.Run()
	_, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
	_ = admin.Close(ctx)
	os.Exit(code)
}

// newLedger returns a ledger on a migrated schema of the test's own (ledgerOn).
func newLedger(t *testing.T, cfg ledger.Config) (*ledger.Ledger, *pgxpool.Pool) {
	t.Helper()
	pool, _ := testenv.Postgres(t)
	return ledgerOn(t, pool, cfg), pool
}

// ledgerOn returns a ledger on pool, with cfg's Logger filled in when unset.
func ledgerOn(t *testing.T, pool *pgxpool.Pool, cfg ledger.Config) *ledger.Ledger {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	l, err := ledger.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// tracedLedger is newLedger over a pool whose statements tracer sees.
func tracedLedger(t *testing.T, cfg ledger.Config, tracer pgx.QueryTracer) (*ledger.Ledger, *pgxpool.Pool) {
	t.Helper()
	_, dsn := testenv.Postgres(t)
	pool, err := connect.Postgres(ctxT(t), dsn, tracer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return ledgerOn(t, pool, cfg), pool
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func request(prompt string) *llm.Request {
	return &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: prompt}}}
}

func callOf(work string, req *llm.Request) ledger.Call {
	return ledger.Call{Key: ledger.Key(work, req), Work: work, RequestHash: ledger.RequestHash(req), Provider: "openai", Model: req.Model}
}

func mustGet(t *testing.T, l *ledger.Ledger, key string) *ledger.Row {
	t.Helper()
	r, err := l.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return r
}

// counterValue reads the counter named name with the given labels from reg (0 when
// absent).
func counterValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			return metricValue(m)
		}
	}
	return 0
}

func metricValue(m *dto.Metric) float64 {
	if m.GetCounter() != nil {
		return m.GetCounter().GetValue()
	}
	return m.GetGauge().GetValue()
}

// crashablePostgres is a migrated PostgreSQL of the test's own whose WAL writer waits
// 10 s and whose autovacuum is off: within the test's window only a durable commit
// flushes the WAL (the WAL writer would otherwise write a relaxed commit within 200ms,
// and autovacuum commit behind the test's back), so a SIGKILL loses exactly the relaxed
// commits since the last durable one. open returns a pool on its URL with params
// appended.
func crashablePostgres(t *testing.T, params string) (pg *testenv.Server, open func() *pgxpool.Pool) {
	t.Helper()
	pg = testenv.PrivatePostgres(t)
	dsn := testenv.PostgresURLOf(pg)
	ctx := ctxT(t)
	if _, err := migrations.Up(ctx, dsn, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	open = func() *pgxpool.Pool {
		p, err := connect.Postgres(ctx, dsn+params, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	pool := open()
	for _, sql := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET autovacuum = off`, `SELECT pg_reload_conf()`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	pool.Close()
	time.Sleep(200 * time.Millisecond) // let the WAL writer pick up its new delay
	return pg, open
}

// fakeLLM starts llm/fakeserver (the provider stand-in) and returns it with the real
// OpenAI adapter pointed at it.
func fakeLLM(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, *openai.Client) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	srv, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(func() { srv.Close(); hs.Close() })
	return srv, openai.New(openai.Config{BaseURL: hs.URL + "/v1", APIKey: "sk-test"})
}
