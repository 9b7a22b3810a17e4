package ledger_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// writeCounter is a pgx tracer counting the ledger's in-flight inserts and answers by
// how they reach PostgreSQL: sent alone, or in a batch (one implicit transaction).
type writeCounter struct {
	alone, batches, batched atomic.Int64
}

func ledgerWrite(sql string) bool {
	return strings.Contains(sql, "INSERT INTO llm_calls")
}

func (c *writeCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if ledgerWrite(d.SQL) {
		c.alone.Add(1)
	}
	return ctx
}

func (c *writeCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *writeCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	if n := len(d.Batch.QueuedQueries); n > 0 && ledgerWrite(d.Batch.QueuedQueries[0].SQL) {
		c.batches.Add(1)
		c.batched.Add(int64(n))
	}
	return ctx
}

func (c *writeCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *writeCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// countedLedger returns a ledger over a pool whose ledger writes w counts.
func countedLedger(t *testing.T, cfg ledger.Config) (*ledger.Ledger, *pgxpool.Pool, *writeCounter) {
	t.Helper()
	_, dsn := testenv.Postgres(t)
	w := &writeCounter{}
	pool, err := connect.Postgres(ctxT(t), dsn, w)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	l, err := ledger.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l, pool, w
}

// together runs f(i) for i in [0, n) on n goroutines released at once.
func together(n int, f func(i int)) {
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	ready.Add(n)
	done.Add(n)
	for i := range n {
		go func() {
			defer done.Done()
			ready.Done()
			<-start
			f(i)
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()
}

func TestConcurrentCallsShareGroupTransactions(t *testing.T) {
	t.Parallel()
	l, _, w := countedLedger(t, ledger.Config{})
	ctx := ctxT(t)
	const n = 48
	atts := make([]*ledger.Attempt, n)
	errs := make([]error, n)
	together(n, func(i int) {
		atts[i], _, errs[i] = l.Begin(ctx, callOf("job-"+string(rune('a'+i%26))+string(rune('a'+i/26))+"/s", request("x")))
	})
	for i, err := range errs {
		if err != nil || atts[i] == nil {
			t.Fatalf("Begin %d: %v", i, err)
		}
		if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateInFlight || r.Attempt != 1 {
			t.Fatalf("row %d after Begin: %s, attempt %d", i, r.State, r.Attempt)
		}
	}
	inserts := w.alone.Load() + w.batches.Load()
	if w.alone.Load()+w.batched.Load() != n || inserts >= n/2 {
		t.Fatalf("%d in-flight rows went in %d transactions (%d alone, %d batches of %d rows): want them to share transactions",
			n, inserts, w.alone.Load(), w.batches.Load(), w.batched.Load())
	}

	w.alone.Store(0)
	w.batches.Store(0)
	w.batched.Store(0)
	together(n, func(i int) {
		_, ours, err := atts[i].Succeed(ctx, ledger.ResultOf(&llm.Response{ID: atts[i].Key(), Content: "answer"}))
		if err == nil && !ours {
			err = errors.New("not ours")
		}
		errs[i] = err
	})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Succeed %d: %v", i, err)
		}
		if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateSucceeded {
			t.Fatalf("row %d after Succeed: %s", i, r.State)
		}
	}
	if answers := w.alone.Load() + w.batches.Load(); answers >= n/2 {
		t.Fatalf("%d answers went in %d transactions: want them to share transactions", n, answers)
	}
}

func TestOneFailingWriteOfAGroupFailsOnlyItsCall(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	l, _, w := countedLedger(t, ledger.Config{Registerer: reg})
	ctx := ctxT(t)
	const n = 16
	errs := make([]error, n)
	atts := make([]*ledger.Attempt, n)
	together(n, func(i int) {
		c := callOf("job-"+string(rune('a'+i))+"/s", request("x"))
		if i == 7 {
			c.Work = "job-\x00/s" // PostgreSQL's text holds no NUL: this row cannot be written
		}
		atts[i], _, errs[i] = l.Begin(ctx, c)
	})
	for i, err := range errs {
		switch {
		case i == 7 && !errors.Is(err, ledger.ErrUnavailable):
			t.Fatalf("the call whose row cannot be written: %v, want its own database error", err)
		case i != 7 && (err != nil || atts[i] == nil):
			t.Fatalf("Begin %d, grouped with a call whose row cannot be written: %v", i, err)
		case i != 7:
			if r := mustGet(t, l, atts[i].Key()); r.State != ledger.StateInFlight {
				t.Fatalf("row %d: %s", i, r.State)
			}
		}
	}
	if w.batches.Load() == 0 {
		t.Fatal("no group transaction was tried: the test proves nothing")
	}
	if got := counterValue(t, reg, "onceflow_llm_ledger_group_failures_total", nil); got < 1 {
		t.Fatalf("group failures counted: %v, want at least 1", got)
	}
}

func TestGroupCommitOffWritesEveryCallAlone(t *testing.T) {
	t.Parallel()
	l, _, w := countedLedger(t, ledger.Config{GroupLinger: -1})
	ctx := ctxT(t)
	const n = 16
	together(n, func(i int) {
		att, _, err := l.Begin(ctx, callOf("job-"+string(rune('a'+i))+"/s", request("x")))
		if err == nil {
			_, _, err = att.Succeed(ctx, ledger.ResultOf(&llm.Response{Content: "answer"}))
		}
		if err != nil {
			t.Error(err)
		}
	})
	if w.batches.Load() != 0 || w.alone.Load() != 2*n {
		t.Fatalf("group commit off: %d batches, %d writes alone; want 0 and %d", w.batches.Load(), w.alone.Load(), 2*n)
	}
}

func TestGroupLingerIsBounded(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	if _, err := ledger.New(pool, ledger.Config{GroupLinger: ledger.MaxGroupLinger + 1}); err == nil {
		t.Fatal("a GroupLinger above MaxGroupLinger was accepted")
	}
	if _, err := ledger.New(pool, ledger.Config{GroupMax: -1}); err == nil {
		t.Fatal("a negative GroupMax was accepted")
	}
}
