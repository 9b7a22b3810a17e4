package summaries_test

// Pipeline-level tests of the summaries handler with the llm_calls ledger (issue 7):
// real Redis Streams workers, real PostgreSQL, the real OpenAI adapter against
// fake-llm over HTTP. Helpers here are prefixed lg so they cannot clash with the
// pipeline suite's.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

// lgEnv is one test's queue, database, model and ledger.
type lgEnv struct {
	rdb    *redis.Client
	keys   queue.Keys
	pool   *pgxpool.Pool
	fake   *fakeserver.Server
	gate   *lgGate
	model  *openai.Client
	ledger *ledger.Ledger
}

// lgGate holds the first model request until Release, so a test can act while a call
// is in flight; later requests pass.
type lgGate struct {
	next    http.Handler
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
	mu      sync.Mutex
	n       int
}

func (g *lgGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.mu.Lock()
	g.n++
	first := g.n == 1
	g.mu.Unlock()
	if first {
		g.arrived <- struct{}{}
		<-g.release
	}
	g.next.ServeHTTP(w, r)
}

func (g *lgGate) Release() { g.once.Do(func() { close(g.release) }) }

func (g *lgGate) requests() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
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

func (e *lgEnv) enqueue(t *testing.T, jobID, text string) {
	t.Helper()
	payload, _ := json.Marshal(summaries.Request{Text: text, Notify: "ops@example.com"})
	if _, err := queue.Enqueue(context.Background(), e.rdb, e.keys, queue.Message{JobID: jobID, Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
}

// lgOutcome is one run of the handler.
type lgOutcome struct {
	outcome    summaries.Outcome
	err        error
	deliveries int64
}

// lgRecorder runs a handler and records what each run returned.
type lgRecorder struct {
	h    *testHandler
	mu   sync.Mutex
	runs []lgOutcome
}

func (r *lgRecorder) Handle(ctx context.Context, job *queue.Job) error {
	out, err := r.h.Process(ctx, job)
	r.mu.Lock()
	r.runs = append(r.runs, lgOutcome{out, err, job.Deliveries})
	r.mu.Unlock()
	return err
}

func (r *lgRecorder) Runs() []lgOutcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]lgOutcome(nil), r.runs...)
}

func (e *lgEnv) handler(t *testing.T, withLedger bool) *lgRecorder {
	t.Helper()
	cfg := handlerConfig{Model: "gpt-4.1-mini", Provider: "openai", Logger: testenv.Logger(t),
		Retry: retry.Policy{Base: 10 * time.Millisecond, Cap: 50 * time.Millisecond, MinAttempt: 100 * time.Millisecond}}
	if withLedger {
		cfg.Ledger, cfg.LedgerConfig = e.ledger, ledger.Config{Wait: 30 * time.Second}
	}
	h := newHandler(t, e.pool, e.model, cfg)
	return &lgRecorder{h: h}
}

func (e *lgEnv) worker(t *testing.T, h queue.Handler, consumer string, claimIdle time.Duration) (stop func()) {
	t.Helper()
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.rdb, Keys: e.keys, Handler: h, Consumer: consumer,
		ClaimIdle: claimIdle, RenewInterval: -1, ClaimInterval: 50 * time.Millisecond, Block: 100 * time.Millisecond,
		ShutdownTimeout: 5 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

func (e *lgEnv) rows(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A slow worker and a reclaimer on one job (docs/queue.md's case): worker a is still waiting
// for the model when worker b reclaims the entry. With the ledger, b finds a's call in
// flight (a renews its lease) and waits for it instead of calling too; when a's answer
// is recorded, b replays it. ONE model call (without the ledger, the pipeline suite's
// TestSlowWorkerAndReclaimer counts two; the subtest "without ledger" shows it here), one
// summary, one outbox row: results done (a) and duplicate (b).
func TestSlowWorkerAndReclaimerMakeOneModelCallWithTheLedger(t *testing.T) {
	t.Parallel()
	for _, withLedger := range []bool{true, false} {
		t.Run(fmt.Sprintf("ledger=%v", withLedger), func(t *testing.T) {
			t.Parallel()
			e := lgSetup(t)
			const jobID = "00000000-0000-4000-8000-00000000a701"
			e.enqueue(t, jobID, "A slow model call.")
			a := e.handler(t, withLedger)
			stopA := e.worker(t, a, "worker-a", time.Hour)
			select {
			case <-e.gate.arrived:
			case <-time.After(30 * time.Second):
				t.Fatal("worker a never called the model")
			}
			b := e.handler(t, withLedger)
			stopB := e.worker(t, b, "worker-b", 300*time.Millisecond)
			if withLedger {
				// b reclaims the entry and reaches the ledger, where a's call is in flight:
				// it waits. Give it time to do something wrong (call the model) if it would.
				testenv.WaitFor(t, 30*time.Second, "worker b to reclaim the entry", func() bool {
					p, _ := e.rdb.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: e.keys.Stream(), Group: queue.DefaultGroup, Start: "-", End: "+", Count: 1}).Result()
					return len(p) == 1 && p[0].Consumer == "worker-b"
				})
				time.Sleep(500 * time.Millisecond)
				if n := e.gate.requests(); n != 1 || len(b.Runs()) > 0 {
					t.Fatalf("while a's call was in flight, b made %d model calls and finished %+v", n-1, b.Runs())
				}
				e.gate.Release()
			} else {
				testenv.WaitFor(t, 30*time.Second, "worker b to finish", func() bool { return len(b.Runs()) == 1 })
				e.gate.Release()
			}
			testenv.WaitFor(t, 30*time.Second, "both workers to finish", func() bool { return len(a.Runs()) == 1 && len(b.Runs()) == 1 })
			stopA()
			stopB()

			calls := e.fake.Stats().Requests
			ra, rb := a.Runs()[0], b.Runs()[0]
			if ra.err != nil || rb.err != nil || rb.deliveries != 2 {
				t.Fatalf("worker a %+v, worker b %+v", ra, rb)
			}
			if withLedger {
				// Both get the one recorded answer once a's call ends; which of them then
				// commits first is a race (a usually, b when its poll of the ledger lands
				// right after a's record and a is descheduled): one done, one duplicate.
				done := map[summaries.Outcome]int{ra.outcome: 1}
				done[rb.outcome]++
				if calls != 1 || done[summaries.OutcomeDone] != 1 || done[summaries.OutcomeDuplicate] != 1 {
					t.Fatalf("with the ledger: %d model calls, a %s, b %s; want 1, one done and one duplicate", calls, ra.outcome, rb.outcome)
				}
				st, err := ledger.ReadStats(context.Background(), e.pool)
				if err != nil || len(st) != 1 || st[0].Succeeded != 1 || st[0].Attempts != 1 || st[0].Ambiguous != 0 {
					t.Fatalf("ledger %+v %v", st, err)
				}
			} else if calls != 2 || ra.outcome != summaries.OutcomeDuplicate || rb.outcome != summaries.OutcomeDone {
				t.Fatalf("without the ledger: %d model calls, a %s, b %s; want 2, duplicate, done", calls, ra.outcome, rb.outcome)
			}
			if s, o := e.rows(t, `SELECT count(*) FROM summaries`), e.rows(t, `SELECT count(*) FROM outbox`); s != 1 || o != 1 {
				t.Fatalf("%d summaries, %d outbox rows", s, o)
			}
		})
	}
}

// The model answered and its answer was recorded, then the summary's transaction failed
// (a trigger makes the INSERT fail, as a constraint, a full disk or a failover would):
// the job stays pending, and its redelivery replays the recorded answer. ONE model call.
// Without the ledger the redelivery calls the model again (the control subtest).
func TestSummaryTransactionFailedAfterTheCallRedeliveryDoesNotCallTheModel(t *testing.T) {
	t.Parallel()
	for _, withLedger := range []bool{true, false} {
		t.Run(fmt.Sprintf("ledger=%v", withLedger), func(t *testing.T) {
			t.Parallel()
			e := lgSetup(t)
			e.gate.Release() // no gating here
			ctx := context.Background()
			for _, sql := range []string{
				`CREATE TABLE fail_summaries (reason text)`,
				`CREATE FUNCTION fail_summary() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					IF EXISTS (SELECT 1 FROM fail_summaries) THEN RAISE EXCEPTION 'injected: the summary transaction fails'; END IF;
					RETURN NEW;
				END $$`,
				`CREATE TRIGGER fail_summary BEFORE INSERT ON summaries FOR EACH ROW EXECUTE FUNCTION fail_summary()`,
				`INSERT INTO fail_summaries VALUES ('first delivery')`,
			} {
				if _, err := e.pool.Exec(ctx, sql); err != nil {
					t.Fatal(err)
				}
			}
			const jobID = "00000000-0000-4000-8000-00000000a702"
			e.enqueue(t, jobID, "The quarter in three lines.")
			h := e.handler(t, withLedger)
			e.worker(t, h, "worker", 500*time.Millisecond)
			testenv.WaitFor(t, 30*time.Second, "the first delivery to fail", func() bool { return len(h.Runs()) >= 1 })
			if r := h.Runs()[0]; r.err == nil || r.deliveries != 1 || e.fake.Stats().Requests != 1 {
				t.Fatalf("first delivery: %+v after %d model calls", r, e.fake.Stats().Requests)
			}
			if _, err := e.pool.Exec(ctx, `DELETE FROM fail_summaries`); err != nil { // the database recovers
				t.Fatal(err)
			}
			testenv.WaitFor(t, 30*time.Second, "the redelivery to store the summary", func() bool {
				runs := h.Runs()
				return len(runs) > 0 && runs[len(runs)-1].outcome == summaries.OutcomeDone
			})
			runs := h.Runs()
			calls := e.fake.Stats().Requests
			want := int64(1)
			if !withLedger {
				want = int64(len(runs)) // every delivery paid for a call
			}
			if calls != want || len(runs) < 2 {
				t.Fatalf("%d model calls over %d deliveries, want %d", calls, len(runs), want)
			}
			if withLedger && calls != 1 {
				t.Fatalf("the redelivery called the model")
			}
			if s, o := e.rows(t, `SELECT count(*) FROM summaries`), e.rows(t, `SELECT count(*) FROM outbox`); s != 1 || o != 1 {
				t.Fatalf("%d summaries, %d outbox rows", s, o)
			}
		})
	}
}

// onceflow audit's report counts the ledger per provider and model, beside the
// documented fields.
func TestAuditReportsTheLedger(t *testing.T) {
	t.Parallel()
	e := lgSetup(t)
	ctx := context.Background()
	att, _, err := e.ledger.Begin(ctx, ledger.Call{Key: "k1", RequestHash: "h", Provider: "openai", Model: "gpt-4.1-mini"})
	if err != nil {
		t.Fatal(err)
	}
	if err := att.Fail(ctx, context.DeadlineExceeded, true); err != nil {
		t.Fatal(err)
	}
	r, err := summaries.Audit(ctx, summaries.AuditConfig{DB: e.pool, Redis: e.rdb, Keys: e.keys})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(r)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	for _, f := range []string{"summaries", "outbox_total", "outbox_sent", "outbox_unsent", "outbox_exhausted", "dlq", "stream_pending", "violations", "llm_calls"} {
		if _, ok := m[f]; !ok {
			t.Errorf("audit JSON lacks %q: %s", f, b)
		}
	}
	if len(r.LLMCalls) != 1 || r.LLMCalls[0].Ambiguous != 1 || r.LLMCalls[0].Abandoned != 1 || len(r.Violations) != 0 {
		t.Fatalf("report %s", b)
	}
}
