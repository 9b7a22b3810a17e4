package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
)

// Recorded steps (Do) and tool calls (Job.Tool, Job.ToolAtMostOnce) against real Redis
// and PostgreSQL: every test counts how often the recorded function ran.

type orderArgs struct {
	Order string `json:"order"`
}

func (orderArgs) Kind() string { return "test.order" }

// stepEnv is one test's stores and a client running work for orderArgs.
type stepEnv struct {
	t      *testing.T
	rdb    *redis.Client
	prefix string
	pool   *pgxpool.Pool
	client *onceflow.Client
	runs   *runLog
}

// newStepEnv builds a client whose model is model (nil: none) and whose worker runs work,
// redelivering a failed job within tens of milliseconds.
func newStepEnv(t *testing.T, model llm.Client, work func(ctx context.Context, j *onceflow.Job[orderArgs]) error) *stepEnv {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	return newStepEnvWith(t, rdb, prefix, model, work)
}

func (e *stepEnv) start() { e.t.Helper(); runClient(e.t, e.client) }

func (e *stepEnv) enqueue(order string) string {
	e.t.Helper()
	res, err := e.client.Enqueue(context.Background(), orderArgs{Order: order}, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return res.JobID
}

// waitStatus waits until job id has status.
func (e *stepEnv) waitStatus(id string, want onceflow.Status) *onceflow.JobState {
	e.t.Helper()
	var st *onceflow.JobState
	testenv.WaitFor(e.t, 20*time.Second, "job status "+string(want), func() bool {
		var err error
		st, err = e.client.JobState(context.Background(), "", id)
		return err == nil && st.Status == want
	})
	return st
}

// waitRuns waits for n runs of the worker and returns them.
func (e *stepEnv) waitRuns(n int) []run {
	e.t.Helper()
	testenv.WaitFor(e.t, 20*time.Second, fmt.Sprintf("%d worker runs", n), func() bool { return len(e.runs.all()) >= n })
	return e.runs.all()
}

// A step's first result is recorded and every later delivery gets it back without
// running the step again, even when running it again would give another answer.
func TestDoReplaysTheFirstResultToLaterDeliveries(t *testing.T) {
	t.Parallel()
	var ran atomic.Int64
	var mu sync.Mutex
	var got []string
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		v, err := onceflow.Do(ctx, j, "lookup", func(ctx context.Context) (string, error) {
			return fmt.Sprintf("order %s updated_at=%d", j.Args.Order, ran.Add(1)), nil
		})
		if err != nil {
			return err
		}
		mu.Lock()
		got = append(got, v)
		mu.Unlock()
		if j.Delivery == 1 {
			return errCrash
		}
		return nil
	})
	e.enqueue("A-1")
	e.start()
	e.waitRuns(2)
	if n := ran.Load(); n != 1 {
		t.Fatalf("the step ran %d times, want 1", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 2 || got[0] != got[1] || got[0] != "order A-1 updated_at=1" {
		t.Fatalf("deliveries got %q, want the first result twice", got)
	}
}

// A failed step records nothing: the next delivery runs it again and records that run.
func TestDoRecordsNoFailure(t *testing.T) {
	t.Parallel()
	var ran atomic.Int64
	results := make(chan int64, 4)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		v, err := onceflow.Do(ctx, j, "charge", func(ctx context.Context) (int64, error) {
			n := ran.Add(1)
			if n == 1 {
				return 0, errors.New("payments API: 503")
			}
			return n, nil
		})
		if err == nil {
			results <- v
		}
		return err
	})
	e.enqueue("A-2")
	e.start()
	e.waitRuns(2)
	if v := <-results; v != 2 {
		t.Fatalf("the second delivery got %d, want its own run's 2", v)
	}
	if n := ran.Load(); n != 2 {
		t.Fatalf("the step ran %d times, want 2 (once failing, once recorded)", n)
	}
}

// Steps running at once in one job (deliveries racing after a takeover) all return the
// result that was recorded first.
func TestConcurrentRunsOfAStepReturnTheFirstRecord(t *testing.T) {
	t.Parallel()
	var ran atomic.Int64
	got := make(chan string, 4)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				v, err := onceflow.Do(ctx, j, "create", func(ctx context.Context) (string, error) {
					return fmt.Sprintf("run-%d", ran.Add(1)), nil
				})
				if err != nil {
					t.Error(err)
				}
				got <- v
			})
		}
		wg.Wait()
		close(got)
		return nil
	})
	e.enqueue("A-3")
	e.start()
	e.waitRuns(1)
	var first string
	for v := range got {
		if first == "" {
			first = v
		}
		if v != first {
			t.Fatalf("concurrent runs returned %q and %q, want one recorded result", first, v)
		}
	}
}

// Step names are checked before anything runs.
func TestDoRefusesBadStepNames(t *testing.T) {
	t.Parallel()
	errs := make(chan error, 3)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		for _, name := range []string{"", "tool:x", strings.Repeat("n", onceflow.MaxStepNameLen+1)} {
			_, err := onceflow.Do(ctx, j, name, func(ctx context.Context) (int, error) {
				t.Errorf("step %q ran", name)
				return 0, nil
			})
			errs <- err
		}
		return nil
	})
	e.enqueue("A-4")
	e.start()
	e.waitRuns(1)
	for range 3 {
		if err := <-errs; err == nil || !onceflow.IsPermanent(err) {
			t.Fatalf("bad step name: %v, want a permanent error", err)
		}
	}
}

// Another tenant's record of a step under the same job id is not this job's.
func TestRecordedStepsAreTenantScoped(t *testing.T) {
	t.Parallel()
	var ran atomic.Int64
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.Do(ctx, j, "lookup", func(ctx context.Context) (string, error) {
			ran.Add(1)
			return "mine", nil
		})
		return err
	})
	id := e.enqueue("A-5")
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO job_steps (tenant, job_id, name, state, result, expires_at)
VALUES ('other', $1, 'lookup', 'done', '"theirs"', now() + interval '1 hour')`, id); err != nil {
		t.Fatal(err)
	}
	e.start()
	e.waitRuns(1)
	if n := ran.Load(); n != 1 {
		t.Fatalf("the step ran %d times, want 1: another tenant's record is not this job's", n)
	}
}

// A job whose at-most-once tool was started and never recorded is dead-lettered in
// doubt, shown so by JobState; an operator who says it happened records its result,
// and the job, put back, continues from it without calling the tool again.
func TestInDoubtToolResolvedAsHappenedIsNotCalledAgain(t *testing.T) {
	t.Parallel()
	var sent atomic.Int64
	results := make(chan string, 2)
	e := newStepEnv(t, onceflowtestModel("send_email", `{"to":"a@example.com"}`), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		st, err := j.Complete(ctx, "plan", prompt(j.Args.Order))
		if err != nil {
			return err
		}
		calls := j.ToolCalls(st)
		r, err := j.ToolAtMostOnce(ctx, calls[0], func(ctx context.Context, key string) (string, error) {
			if sent.Add(1) == 1 {
				panic("the process died while the email was being sent")
			}
			return "sent again", nil
		})
		if err != nil {
			return err
		}
		results <- r
		return nil
	})
	id := e.enqueue("A-6")
	e.start()
	st := e.waitStatus(id, onceflow.StatusInDoubt)
	if len(st.InDoubt) != 1 || st.InDoubt[0].Tool != "send_email" || st.InDoubt[0].Arguments != `{"to":"a@example.com"}` {
		t.Fatalf("in doubt: %+v", st.InDoubt)
	}
	if n := sent.Load(); n != 1 {
		t.Fatalf("the tool ran %d times before the job went in doubt, want 1", n)
	}
	list, err := e.client.Inspector().InDoubt(context.Background(), 10)
	if err != nil || len(list) != 1 || list[0].JobID != id || len(list[0].Calls) != 1 {
		t.Fatalf("InDoubt: %+v, %v", list, err)
	}
	in := e.client.Inspector()
	if err := in.ResolveInDoubt(context.Background(), "other-tenant", id, st.InDoubt[0].Key, onceflow.Resolution{Happened: true}); !errors.Is(err, onceflow.ErrNotInDoubt) {
		t.Fatalf("another tenant resolved the call: %v", err)
	}
	if err := in.ResolveInDoubt(context.Background(), "", id, st.InDoubt[0].Key, onceflow.Resolution{Happened: true, Result: "sent by hand"}); err != nil {
		t.Fatal(err)
	}
	if r := <-results; r != "sent by hand" {
		t.Fatalf("the job continued with %q, want the operator's result", r)
	}
	e.waitStatus(id, onceflow.StatusDone)
	if n := sent.Load(); n != 1 {
		t.Fatalf("the tool ran %d times, want 1: the operator said it happened", n)
	}
	if err := in.ResolveInDoubt(context.Background(), "", id, st.InDoubt[0].Key, onceflow.Resolution{}); !errors.Is(err, onceflow.ErrNotInDoubt) {
		t.Fatalf("a second resolution: %v, want ErrNotInDoubt", err)
	}
}

// An operator who says the call did not happen puts the job back, and it calls the tool
// again, once.
func TestInDoubtToolResolvedAsNotHappenedIsCalledAgain(t *testing.T) {
	t.Parallel()
	var sent atomic.Int64
	e := newStepEnv(t, onceflowtestModel("send_email", `{"to":"b@example.com"}`), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		st, err := j.Complete(ctx, "plan", prompt(j.Args.Order))
		if err != nil {
			return err
		}
		_, err = j.ToolAtMostOnce(ctx, j.ToolCalls(st)[0], func(ctx context.Context, key string) (string, error) {
			if sent.Add(1) == 1 {
				return "", fmt.Errorf("SMTP: timeout after DATA: %w", onceflow.ErrInDoubt)
			}
			return "sent", nil
		})
		return err
	})
	id := e.enqueue("A-7")
	e.start()
	st := e.waitStatus(id, onceflow.StatusInDoubt)
	if err := e.client.Inspector().ResolveInDoubt(context.Background(), "", id, st.InDoubt[0].Key, onceflow.Resolution{}); err != nil {
		t.Fatal(err)
	}
	e.waitStatus(id, onceflow.StatusDone)
	if n := sent.Load(); n != 2 {
		t.Fatalf("the tool ran %d times, want 2: once in doubt, once after the operator's retry", n)
	}
}

// A tool's failure that says it did not happen removes the intent: the next delivery
// calls the tool again instead of going in doubt.
func TestToolAtMostOnceFailureCallsAgain(t *testing.T) {
	t.Parallel()
	var sent atomic.Int64
	e := newStepEnv(t, onceflowtestModel("send_email", `{"to":"c@example.com"}`), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		st, err := j.Complete(ctx, "plan", prompt(j.Args.Order))
		if err != nil {
			return err
		}
		_, err = j.ToolAtMostOnce(ctx, j.ToolCalls(st)[0], func(ctx context.Context, key string) (string, error) {
			if sent.Add(1) == 1 {
				return "", errors.New("SMTP: 421 try again later")
			}
			return "sent", nil
		})
		return err
	})
	id := e.enqueue("A-8")
	e.start()
	e.waitStatus(id, onceflow.StatusDone)
	if n := sent.Load(); n != 2 {
		t.Fatalf("the tool ran %d times, want 2", n)
	}
}

// A call that Job.ToolCalls did not key is refused.
func TestToolRefusesACallWithoutKey(t *testing.T) {
	t.Parallel()
	errs := make(chan error, 2)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		call := onceflow.ToolCall{ToolCall: llm.ToolCall{ID: "call_1", Name: "refund", Arguments: "{}"}}
		fn := func(ctx context.Context, key string) (string, error) { t.Error("the tool ran"); return "", nil }
		_, err := j.Tool(ctx, call, fn)
		errs <- err
		_, err = j.ToolAtMostOnce(ctx, call, fn)
		errs <- err
		return nil
	})
	e.enqueue("A-9")
	e.start()
	for range 2 {
		if err := <-errs; !onceflow.IsPermanent(err) {
			t.Fatalf("unkeyed call: %v, want a permanent error", err)
		}
	}
}

// onceflowtestModel is a scripted model whose first answer calls tool with args, and
// whose answers after a tool result are text.
func onceflowtestModel(tool, args string) *onceflowtest.ScriptedModel {
	return &onceflowtest.ScriptedModel{Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{{Name: tool, Arguments: args}}},
		{Text: "done"},
	}}
}

// A job in doubt waits in the dead-letter queue for an operator, however long that
// takes: its intent is kept as long as a dead letter is (the queue's
// DeadLetterRetention, 30 days by default), not for the records' retention (24 h), or a
// replay of the dead letter after the purge would find no intent and call the
// at-most-once tool again.
func TestAnInDoubtIntentIsKeptAsLongAsItsDeadLetter(t *testing.T) {
	t.Parallel()
	e := newStepEnv(t, onceflowtestModel("send_email", `{"to":"a@example.com"}`), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		st, err := j.Complete(ctx, "plan", prompt(j.Args.Order))
		if err != nil {
			return err
		}
		_, err = j.ToolAtMostOnce(ctx, j.ToolCalls(st)[0], func(ctx context.Context, key string) (string, error) {
			return "", fmt.Errorf("SMTP: timeout after DATA: %w", onceflow.ErrInDoubt)
		})
		return err
	})
	id := e.enqueue("P-1")
	e.start()
	st := e.waitStatus(id, onceflow.StatusInDoubt)
	var kept, records bool
	if err := e.pool.QueryRow(context.Background(), `SELECT
	(SELECT bool_and(expires_at > now() + interval '29 days') FROM job_steps WHERE job_id = $1 AND state = 'intent'),
	(SELECT bool_and(expires_at < now() + interval '25 hours') FROM llm_calls WHERE split_part(work, '/', 2) = $1)`, id).Scan(&kept, &records); err != nil {
		t.Fatal(err)
	}
	if !kept || !records {
		t.Fatalf("intent kept for the dead letter's 30 days: %v (the model call's row for its own 24 h: %v)", kept, records)
	}
	if err := e.client.Inspector().ResolveInDoubt(context.Background(), "", id, st.InDoubt[0].Key, onceflow.Resolution{Happened: true, Result: "sent"}); err != nil {
		t.Fatal(err)
	}
	// The resolved call's record is kept as long: should the job not be put back at
	// once (Redis down), a later replay must still find the result.
	var resolved bool
	if err := e.pool.QueryRow(context.Background(), `SELECT bool_and(expires_at > now() + interval '29 days') FROM job_steps WHERE job_id = $1 AND state = 'done' AND name LIKE 'tool:%'`,
		id).Scan(&resolved); err != nil || !resolved {
		t.Fatalf("the resolved call's record is kept as long as the intent was: %v %v", resolved, err)
	}
}
