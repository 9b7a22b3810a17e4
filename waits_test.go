package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/onceflow/onceflow/onceflowtest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// Waits against real Redis and PostgreSQL: a waiting job holds no worker and spends no
// attempt, a signal wakes it, a timeout ends it, and an approval is asked once.

// pendingRuns counts the job's entries pending in the stream (held by a worker).
func (e *stepEnv) pending() int64 {
	e.t.Helper()
	p, err := e.rdb.XPending(context.Background(), e.client.Inspector().QueueKeys(onceflow.DefaultQueue).Stream(), queue.DefaultGroup).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return p.Count
}

// A job waiting for a signal parks in the scheduled set (queued, waiting for the
// signal, no worker holding it); Signal wakes it within the mover's interval, and the
// job gets the payload, its earlier step not run again.
func TestSignalWakesAWaitingJob(t *testing.T) {
	t.Parallel()
	var before atomic.Int64
	got := make(chan string, 1)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		if _, err := onceflow.Do(ctx, j, "before", func(ctx context.Context) (int64, error) { return before.Add(1), nil }); err != nil {
			return err
		}
		payload, err := onceflow.WaitSignal(ctx, j, "paid", time.Hour)
		if err != nil {
			return err
		}
		got <- string(payload)
		return nil
	})
	id := e.enqueue("A-1")
	e.start()
	var st *onceflow.JobState
	testenv.WaitFor(t, 10*time.Second, "the job to wait", func() bool {
		var err error
		st, err = e.client.JobState(context.Background(), "", id)
		return err == nil && st.Waiting != ""
	})
	if st.Status != onceflow.StatusQueued || st.Waiting != "signal paid" || time.Until(st.RunAt) < 50*time.Minute {
		t.Fatalf("waiting job: %+v", st)
	}
	if n := e.pending(); n != 0 {
		t.Fatalf("%d entries held by workers while the job waits, want 0", n)
	}
	if err := e.client.Signal(context.Background(), "other", id, "paid", map[string]int{"cents": 1}); !errors.Is(err, onceflow.ErrJobNotFound) {
		t.Fatalf("another tenant's signal: %v, want ErrJobNotFound", err)
	}
	if err := e.client.Signal(context.Background(), "", id, "paid", map[string]int{"cents": 1250}); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-got:
		if p != `{"cents":1250}` {
			t.Fatalf("payload %s", p)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the signal did not wake the job")
	}
	e.waitStatus(id, onceflow.StatusDone)
	if n := before.Load(); n != 1 {
		t.Fatalf("the step before the wait ran %d times, want 1", n)
	}
	for _, r := range e.runs.all() {
		if r.delivery != 1 {
			t.Fatalf("a run with delivery %d: waiting spent an attempt", r.delivery)
		}
	}
	if err := e.client.Signal(context.Background(), "", id, "paid", 1); !errors.Is(err, onceflow.ErrAlreadySignalled) {
		t.Fatalf("a second signal: %v, want ErrAlreadySignalled", err)
	}
}

// A signal that arrives while the job runs, before it parks, is not lost: the job runs
// again at once instead of sleeping until its timeout.
func TestSignalBeforeTheJobParksIsNotLost(t *testing.T) {
	t.Parallel()
	entered := make(chan struct{})
	proceed := make(chan struct{})
	got := make(chan string, 1)
	var first atomic.Bool
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		payload, err := onceflow.WaitSignal(ctx, j, "go", time.Hour)
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-proceed // the signal is sent now, between the look and the park
		}
		if err != nil {
			return err
		}
		got <- string(payload)
		return nil
	})
	id := e.enqueue("A-2")
	e.start()
	<-entered
	if err := e.client.Signal(context.Background(), "", id, "go", "now"); err != nil {
		t.Fatal(err)
	}
	close(proceed)
	select {
	case p := <-got:
		if p != `"now"` {
			t.Fatalf("payload %s", p)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the signal sent before the job parked was lost")
	}
}

// A wait whose signal never comes ends with ErrWaitTimedOut, permanently; Sleep returns
// once its time passed, without sleeping again on a redelivery.
func TestWaitTimesOutAndSleepEnds(t *testing.T) {
	t.Parallel()
	errs := make(chan error, 1)
	var slept atomic.Int64
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		if j.Args.Order == "sleep" {
			if err := onceflow.Sleep(ctx, j, "nap", 300*time.Millisecond); err != nil {
				return err
			}
			slept.Add(1)
			return nil
		}
		_, err := onceflow.WaitSignal(ctx, j, "never", 300*time.Millisecond)
		if !errors.Is(err, retry.ErrWaiting) {
			errs <- err
		}
		return err
	})
	sleeper := e.enqueue("sleep")
	waiter := e.enqueue("wait")
	e.start()
	err := <-errs
	if !errors.Is(err, onceflow.ErrWaitTimedOut) || !onceflow.IsPermanent(err) {
		t.Fatalf("wait: %v, want a permanent ErrWaitTimedOut", err)
	}
	e.waitStatus(waiter, onceflow.StatusFailed)
	e.waitStatus(sleeper, onceflow.StatusDone)
	if n := slept.Load(); n != 1 {
		t.Fatalf("the job went on after its sleep %d times, want 1", n)
	}
}

// A tool call that needs approval parks the job until an operator decides; the
// approved call runs once, and a resumed run never asks twice. A rejected call does not
// run, and the model is told.
func TestApprovalParksTheJobAndRunsTheApprovedCallOnce(t *testing.T) {
	t.Parallel()
	for _, approve := range []bool{true, false} {
		t.Run(map[bool]string{true: "approved", false: "rejected"}[approve], func(t *testing.T) {
			t.Parallel()
			agent := newOrderAgent()
			tools := agent.tools()
			tools[1] = onceflow.NeedsApproval(tools[1], func(a refundToolArgs) bool { return a.Amount > 1000 })
			model := refundScript(true)
			answers := make(chan []llm.Message, 1)
			e := newStepEnv(t, model, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
				res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: tools})
				if err != nil {
					return err
				}
				answers <- res.Messages
				return nil
			})
			id := e.enqueue("A-1")
			e.start()
			in := e.client.Inspector()
			var pending []onceflow.Approval
			testenv.WaitFor(t, 10*time.Second, "an approval to be asked", func() bool {
				var err error
				pending, err = in.Approvals(context.Background(), "", false, 10)
				return err == nil && len(pending) == 1
			})
			a := pending[0]
			if a.JobID != id || a.Tool != "issue_refund" || !strings.Contains(a.Arguments, "1250") || len(a.Messages) < 2 {
				t.Fatalf("approval %+v", a)
			}
			// The conversation the operator reads ends with the model's turn that asked.
			if last := a.Messages[len(a.Messages)-1]; last.Role != llm.RoleAssistant || len(last.ToolCalls) != 1 ||
				last.ToolCalls[0].Name != "issue_refund" || last.ToolCalls[0].ID != toolkey.CallID(a.Key) {
				t.Fatalf("the approval's conversation ends with %+v, want the assistant's call of issue_refund", last)
			}
			if other, _ := in.Approvals(context.Background(), "other", false, 10); len(other) != 0 {
				t.Fatalf("another tenant sees %d approvals", len(other))
			}
			if refunds, _ := agent.effects(); refunds != 0 {
				t.Fatal("the refund ran before its approval")
			}
			testenv.WaitFor(t, 10*time.Second, "the job to wait in the scheduled set", func() bool {
				st, err := e.client.JobState(context.Background(), "", id)
				return err == nil && strings.HasPrefix(st.Waiting, "signal approval:")
			})
			if n := e.pending(); n != 0 {
				t.Fatalf("%d entries held by workers while the approval waits, want 0", n)
			}
			// The turns' ledger rows and the job's records outlive the wait (its deadline,
			// 24h, plus their own retention, 24h).
			var calls, records bool
			if err := e.pool.QueryRow(context.Background(), `SELECT
	(SELECT bool_and(expires_at > now() + interval '47 hours') FROM llm_calls WHERE split_part(work, '/', 2) = $1),
	(SELECT bool_and(expires_at > now() + interval '47 hours') FROM job_steps WHERE job_id = $1)`, id).Scan(&calls, &records); err != nil || !calls || !records {
				t.Fatalf("while waiting, ledger rows outlive the wait: %v, records: %v (%v)", calls, records, err)
			}
			if err := e.client.Approve(context.Background(), "other", id, a.Key, "mallory", ""); !errors.Is(err, onceflow.ErrNotWaiting) {
				t.Fatalf("another tenant's approval: %v, want ErrNotWaiting", err)
			}
			decide := e.client.Reject
			if approve {
				decide = e.client.Approve
			}
			if err := decide(context.Background(), "", id, a.Key, "ops@example.com", "checked the order"); err != nil {
				t.Fatal(err)
			}
			// The same decision again is a retry (nil); the other one is refused.
			other := e.client.Approve
			if approve {
				other = e.client.Reject
			}
			if err := decide(context.Background(), "", id, a.Key, "ops@example.com", "checked the order"); err != nil {
				t.Fatalf("the same decision again: %v, want nil (a retry)", err)
			}
			if err := other(context.Background(), "", id, a.Key, "ops@example.com", ""); !errors.Is(err, onceflow.ErrNotWaiting) {
				t.Fatalf("the other decision: %v, want ErrNotWaiting", err)
			}
			var msgs []llm.Message
			select {
			case msgs = <-answers:
			case <-time.After(10 * time.Second):
				t.Fatal("the decision did not resume the job")
			}
			refunds, requests := agent.effects()
			if approve && (refunds != 1 || requests != 1) || !approve && requests != 0 {
				t.Fatalf("approved %v: %d refunds from %d requests", approve, refunds, requests)
			}
			last, _ := json.Marshal(msgs)
			if !approve && !strings.Contains(string(last), "rejected: the operator did not approve this call: checked the order") {
				t.Fatalf("the model was not told of the rejection: %s", last)
			}
			if n := agent.lookups.Load(); n != 1 {
				t.Fatalf("lookup_order ran %d times across the wait, want 1", n)
			}
			if left, _ := in.Approvals(context.Background(), "", true, 10); len(left) != 0 {
				t.Fatalf("%d approvals still pending after the decision", len(left))
			}
		})
	}
}

// An approval nobody gives in time gets the timeout's outcome: rejected by default.
func TestApprovalTimeoutRejects(t *testing.T) {
	t.Parallel()
	agent := newOrderAgent()
	tools := agent.tools()
	tools[1] = onceflow.NeedsApproval(tools[1], func(refundToolArgs) bool { return true })
	tools[1].ApprovalTimeout = 300 * time.Millisecond
	answers := make(chan string, 1)
	e := newStepEnv(t, refundScript(false), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: tools})
		if err != nil {
			return err
		}
		b, _ := json.Marshal(res.Messages)
		answers <- string(b)
		return nil
	})
	e.enqueue("A-1")
	e.start()
	select {
	case msgs := <-answers:
		if !strings.Contains(msgs, "nobody decided in time") {
			t.Fatalf("the model was not told of the timeout: %s", msgs)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the approval's timeout did not end the wait")
	}
	if _, requests := agent.effects(); requests != 0 {
		t.Fatalf("%d refunds after a timed-out approval, want 0", requests)
	}
	if left, _ := e.client.Inspector().Approvals(context.Background(), "", true, 10); len(left) != 0 {
		t.Fatalf("a timed-out approval is still listed as pending: %+v", left)
	}
}

// An approval decided while Redis is down is recorded but its job is not woken. Once
// Redis is back, the operator retries the decision (the error invites it); the job must
// then run on promptly, not sit parked until the approval's deadline (24 h by default).
func TestApproveRetriedAfterARedisOutageWakesTheJob(t *testing.T) {
	t.Parallel()
	srv, rdb := privateRedisClient(t)
	agent := newOrderAgent()
	tools := agent.tools()
	tools[1] = onceflow.NeedsApproval(tools[1], func(refundToolArgs) bool { return true })
	finished := make(chan struct{}, 1)
	e := newStepEnvOn(t, rdb, refundScript(false), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		if _, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: tools}); err != nil {
			return err
		}
		finished <- struct{}{}
		return nil
	})
	id := e.enqueue("A-1")
	runTolerant(t, e.client)
	in := e.client.Inspector()
	var pending []onceflow.Approval
	testenv.WaitFor(t, 10*time.Second, "an approval to be asked", func() bool {
		var err error
		pending, err = in.Approvals(context.Background(), "", false, 10)
		return err == nil && len(pending) == 1
	})
	testenv.WaitFor(t, 10*time.Second, "the job to park", func() bool {
		st, err := e.client.JobState(context.Background(), "", id)
		return err == nil && strings.HasPrefix(st.Waiting, "signal approval:")
	})

	srv.Stop()
	err := e.client.Approve(context.Background(), "", id, pending[0].Key, "ops", "")
	t.Logf("Approve during the outage: %v", err)
	if err == nil {
		t.Fatal("Approve during a Redis outage reported success")
	}
	srv.Start()
	err = e.client.Approve(context.Background(), "", id, pending[0].Key, "ops", "")
	t.Logf("the same Approve retried after the outage: %v (ErrNotWaiting: %v)", err, errors.Is(err, onceflow.ErrNotWaiting))
	select {
	case <-finished:
	case <-time.After(10 * time.Second):
		st, _ := e.client.JobState(context.Background(), "", id)
		t.Fatalf("the approved job did not run on after Redis came back and the decision was retried: %+v", st)
	}
}

// Sleep is "the same wait, ended by its time only" (docs/workflows-agents.md): a signal
// that happens to carry the sleep's name (any user of SignalHandler can send one) must
// not end it early.
func TestSleepIsEndedByItsTimeOnly(t *testing.T) {
	t.Parallel()
	woke := make(chan struct{}, 1)
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		if err := onceflow.Sleep(ctx, j, "cool-off", time.Hour); err != nil {
			return err
		}
		woke <- struct{}{}
		return nil
	})
	id := e.enqueue("Z-1")
	e.start()
	testenv.WaitFor(t, 10*time.Second, "the job to sleep", func() bool {
		st, err := e.client.JobState(context.Background(), "", id)
		return err == nil && st.Waiting != ""
	})
	if err := e.client.Signal(context.Background(), "", id, "cool-off", "wake up"); err != nil {
		t.Logf("Signal: %v", err)
	}
	select {
	case <-woke:
		t.Fatal("a one-hour Sleep ended at once, on a signal that carried its name")
	case <-time.After(3 * time.Second):
	}
}

// agentqArgs is a job on its own queue, "agentq".
type agentqArgs struct {
	Order string `json:"order"`
}

func (agentqArgs) Kind() string                      { return "test.agentq" }
func (agentqArgs) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "agentq"} }

// Client.Approve decides and wakes the job. Called from a Client that does not host the
// job's queue (an API or CLI process configured with other queues), it says it cannot
// find the job (ErrJobNotFound) and records nothing, rather than recording a decision
// and leaving the job parked until the approval's deadline.
func TestApproveFromAClientWithoutTheJobsQueueFailsAndRecordsNothing(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	agent := newOrderAgent()
	tools := agent.tools()
	tools[1] = onceflow.NeedsApproval(tools[1], func(refundToolArgs) bool { return true })
	finished := make(chan struct{}, 1)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[agentqArgs](func(ctx context.Context, j *onceflow.Job[agentqArgs]) error {
		if _, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: tools}); err != nil {
			return err
		}
		finished <- struct{}{}
		return nil
	}))
	worker, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Workers: ws, Logger: testenv.Logger(t), Model: refundScript(false), ModelRetry: fastRetry,
		Queues: map[string]onceflow.QueueConfig{"agentq": {ClaimIdle: 300 * time.Millisecond, RetryBase: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond}}})
	if err != nil {
		t.Fatal(err)
	}
	api, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	res, err := worker.Enqueue(context.Background(), agentqArgs{Order: "A-1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, worker)
	var pending []onceflow.Approval
	testenv.WaitFor(t, 10*time.Second, "an approval to be asked", func() bool {
		pending, err = api.Inspector().Approvals(context.Background(), "", false, 10)
		return err == nil && len(pending) == 1
	})
	testenv.WaitFor(t, 10*time.Second, "the job to park", func() bool {
		st, err := worker.JobState(context.Background(), "", res.JobID)
		return err == nil && strings.HasPrefix(st.Waiting, "signal approval:")
	})
	// The API client knows none of the job's queues: it says so and records nothing.
	if err := api.Approve(context.Background(), "", res.JobID, pending[0].Key, "ops", ""); !errors.Is(err, onceflow.ErrJobNotFound) {
		t.Fatalf("Approve from a client without the job's queue: %v, want ErrJobNotFound", err)
	}
	if still, err := api.Inspector().Approvals(context.Background(), "", false, 10); err != nil || len(still) != 1 {
		t.Fatalf("after the refused Approve: %d approvals pending (%v), want the one still pending", len(still), err)
	}
	// The worker's client, which hosts the queue, decides and wakes the job.
	if err := worker.Approve(context.Background(), "", res.JobID, pending[0].Key, "ops", ""); err != nil {
		t.Fatal(err)
	}
	select {
	case <-finished:
	case <-time.After(10 * time.Second):
		st, _ := worker.JobState(context.Background(), "", res.JobID)
		t.Fatalf("the approved job did not run on: %+v", st)
	}
}

// "A job waiting for the signal (WaitSignal) runs at once" (SignalHandler, Client.Signal):
// a signal of another name, which the job does not wait for, must not run it again. (Any
// user of the tenant's API key can send any number of names; each run replays the job's
// whole history.)
func TestASignalTheJobDoesNotWaitForDoesNotRunIt(t *testing.T) {
	t.Parallel()
	e := newStepEnv(t, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.WaitSignal(ctx, j, "payment", time.Hour)
		return err
	})
	id := e.enqueue("W-1")
	e.start()
	testenv.WaitFor(t, 10*time.Second, "the job to park", func() bool {
		st, err := e.client.JobState(context.Background(), "", id)
		return err == nil && st.Waiting == "signal payment"
	})
	before := len(e.runs.all())
	for i := range 20 {
		if err := e.client.Signal(context.Background(), "", id, fmt.Sprintf("noise-%d", i), i); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)
	if n := len(e.runs.all()) - before; n != 0 {
		t.Fatalf("20 signals the job does not wait for ran it %d more times", n)
	}
}

// Client.Signal whose wake failed (Redis took no writes for a moment) says the signal is
// recorded. The caller retries once Redis is back; the job waiting for the signal must
// then run, not stay parked until its WaitSignal timeout.
func TestSignalRetriedAfterAFailedWakeRunsTheJob(t *testing.T) {
	t.Parallel()
	r := onceflowtest.PrivateRedis(t)
	got := make(chan string, 1)
	e := newStepEnvOn(t, r.Client, nil, func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		p, err := onceflow.WaitSignal(ctx, j, "payment", time.Hour)
		if err != nil {
			return err
		}
		got <- string(p)
		return nil
	})
	id := e.enqueue("G-1")
	runTolerant(t, e.client)
	testenv.WaitFor(t, 10*time.Second, "the job to park", func() bool {
		st, err := e.client.JobState(context.Background(), "", id)
		return err == nil && st.Waiting == "signal payment"
	})
	resume := r.PauseWrites(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err := e.client.Signal(ctx, "", id, "payment", "paid")
	cancel()
	t.Logf("Signal while Redis takes no writes: %v", err)
	resume()
	if err == nil {
		t.Skip("the wake went through; nothing to retry")
	}
	err = e.client.Signal(context.Background(), "", id, "payment", "paid")
	t.Logf("the same Signal retried: %v", err)
	select {
	case p := <-got:
		t.Logf("the job got %s", p)
	case <-time.After(10 * time.Second):
		st, _ := e.client.JobState(context.Background(), "", id)
		t.Fatalf("the signalled job did not run after the retried Signal: %+v", st)
	}
}

// A call whose timeout's outcome was recorded while its wait stayed open (the process
// died between the two writes) is decided already: a decision on it is refused
// (ErrNotWaiting), not failed for ever, and it closes the wait, so the call leaves the
// operators' list.
func TestDecidingACallItsTimeoutDecidedIsRefusedAndClosesItsWait(t *testing.T) {
	t.Parallel()
	agent := newOrderAgent()
	tools := agent.tools()
	tools[1] = onceflow.NeedsApproval(tools[1], func(refundToolArgs) bool { return true })
	e := newStepEnv(t, refundScript(false), func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: agentRequest(j.Args.Order), Tools: tools})
		return err
	})
	id := e.enqueue("A-1")
	e.start()
	in := e.client.Inspector()
	var pending []onceflow.Approval
	testenv.WaitFor(t, 10*time.Second, "an approval to be asked", func() bool {
		var err error
		pending, err = in.Approvals(context.Background(), "", false, 10)
		return err == nil && len(pending) == 1
	})
	// The timeout's outcome, recorded by a delivery that died before it closed the wait.
	if _, err := e.pool.Exec(context.Background(), `INSERT INTO job_steps (tenant, job_id, name, state, result, expires_at)
VALUES ('', $1, $2, 'done', '{"approved":false,"timed_out":true,"note":"nobody decided in time"}', now() + interval '1 day')`,
		id, "signal:approval:"+pending[0].Key); err != nil {
		t.Fatal(err)
	}
	if err := e.client.Approve(context.Background(), "", id, pending[0].Key, "ops", ""); !errors.Is(err, onceflow.ErrNotWaiting) {
		t.Fatalf("approving a call its timeout decided: %v, want ErrNotWaiting", err)
	}
	if left, err := in.Approvals(context.Background(), "", false, 10); err != nil || len(left) != 0 {
		t.Fatalf("after the refused decision %d approvals are listed (%v), want none", len(left), err)
	}
}
