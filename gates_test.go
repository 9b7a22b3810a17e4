package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
)

// gateEnv runs jobs whose worker asks step "summary" of model "prod" and commits its
// answer as an email, behind gates.
func gateEnv(t *testing.T, model llm.Client, gates []onceflow.Gate) (*onceflowtest.Env, *onceflowtest.Sink) {
	t.Helper()
	sink := onceflowtest.NewSink(t)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		st, err := job.Complete(ctx, "summary", &llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}})
		if err != nil {
			return err
		}
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email", "email:"+job.ID, map[string]string{"summary": st.Response.Content})
			return nil
		})
	}))
	fast := onceflow.QueueConfig{ClaimIdle: time.Second, RetryBase: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond}
	env := onceflowtest.New(t, onceflow.Config{Workers: ws, Model: model, Gates: gates, NoLimits: true,
		Queues:  map[string]onceflow.QueueConfig{onceflow.DefaultQueue: fast},
		Senders: map[string]outbox.Sender{"email": sink.Sender(t, nil)}})
	return env, sink
}

var objectSchema = json.RawMessage(`{"type":"object","required":["label"],"properties":{"label":{"type":"string"}}}`)

// waitHeld waits until job id is held and returns what Inspector.Held says of it.
func waitHeld(t *testing.T, env *onceflowtest.Env, id string) onceflow.Held {
	t.Helper()
	var held []onceflow.Held
	onceflowtest.WaitFor(t, 10*time.Second, "the job held", func() bool {
		st, err := env.Client.JobState(context.Background(), "", id)
		if err != nil || st.Status != onceflow.StatusHeld {
			return false
		}
		held, err = env.Client.Inspector().Held(context.Background(), "", false, 10)
		return err == nil && len(held) == 1
	})
	return held[0]
}

// An answer that fails its gate holds the job before any effect; released, the job
// goes on with that answer and its email goes out once; the same release again is a
// retry, a rejection after it is refused.
func TestGateHoldsAFailingAnswerUntilReleasedAndItsEffectsHappenOnce(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "not JSON at all"}}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Name: "structured", Schema: objectSchema}})
	env.Start()
	res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "classify me"}, &onceflow.EnqueueOpts{Key: "t-1"})
	if err != nil {
		t.Fatal(err)
	}
	h := waitHeld(t, env, res.JobID)
	if h.JobID != res.JobID || h.Gate != "structured" || !strings.Contains(h.Reason, "not JSON") || h.Deadline.IsZero() {
		t.Fatalf("held %+v", h)
	}
	if n := env.OutboxRows(""); n != 0 {
		t.Fatalf("%d effects of a held job, want none", n)
	}
	if n := onceflowtest.Pending(t, env.Redis, env.Prefix, onceflow.DefaultQueue); n != 0 {
		t.Fatalf("%d entries held by workers while the job is held, want 0", n)
	}
	if err := env.Client.Release(context.Background(), "", res.JobID, h.Key, "ops", "looks fine"); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the released job's email", func() bool { return sink.Total() == 1 })
	if err := env.Client.Release(context.Background(), "", res.JobID, h.Key, "ops", "looks fine"); err != nil {
		t.Fatalf("the same release again: %v, want nil (a retry)", err)
	}
	if err := env.Client.RejectHeld(context.Background(), "", res.JobID, h.Key, "ops", ""); !errors.Is(err, onceflow.ErrNotWaiting) {
		t.Fatalf("rejecting a released job: %v, want ErrNotWaiting", err)
	}
	time.Sleep(200 * time.Millisecond) // room for a second email, were one sent
	sink.RequireOncePerKey(t, 1)
	if got := model.count("prod"); got != 1 {
		t.Fatalf("the model was asked %d times, want 1 (the held answer replayed)", got)
	}
}

// A rejected hold fails the job with the gate's reason: nothing is sent.
func TestGateRejectedFailsTheJobAndSendsNothing(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": `{"label":"refund everything"}`}}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Check: func(r *llm.Response) error {
		if strings.Contains(r.Content, "refund") {
			return errors.New("it promises a refund")
		}
		return nil
	}}})
	env.Start()
	res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "angry customer"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := waitHeld(t, env, res.JobID)
	if h.Gate != "summary" || !strings.Contains(h.Reason, "promises a refund") {
		t.Fatalf("held %+v", h)
	}
	if err := env.Client.RejectHeld(context.Background(), "", res.JobID, h.Key, "ops", "off-policy"); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the rejected job failed", func() bool {
		st, err := env.Client.JobState(context.Background(), "", res.JobID)
		return err == nil && st.Status == onceflow.StatusFailed && strings.Contains(st.Error, "eval gate") && strings.Contains(st.Error, "off-policy")
	})
	if n := env.OutboxRows("") + sink.Total(); n != 0 {
		t.Fatalf("%d effects of a rejected job, want none", n)
	}
}

// An answer that fails is asked again of the fallback model; a fallback answer that
// passes is the one the job acts on, and nothing is held.
func TestGateFallbackAnswersInsteadOfHolding(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "bug", "bigger": `{"label":"bug"}`}}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Schema: objectSchema, Fallback: "bigger"}})
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "classify me"}, nil); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the email", func() bool { return sink.Total() == 1 })
	var email struct {
		Payload map[string]string `json:"payload"`
	}
	if err := json.Unmarshal(sink.Deliveries()[0].Body, &email); err != nil || email.Payload["summary"] != `{"label":"bug"}` {
		t.Fatalf("the email %s, want the fallback's answer", sink.Deliveries()[0].Body)
	}
	if held, _ := env.Client.Inspector().Held(context.Background(), "", true, 10); len(held) != 0 || model.count("bigger") != 1 {
		t.Fatalf("%d held, fallback asked %d times; want none held and one fallback call", len(held), model.count("bigger"))
	}
}

// A judge gate holds an answer the judge scores below its threshold, or whose verdict
// it cannot read, and lets one through at or above it. The judge is asked once per
// answer: the delivery that resumes after the release replays its verdict.
func TestGateJudgeHoldsAnswersScoredBelowItsThreshold(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, verdict string
		held          bool
		reason        string
	}{
		{"passing", `{"score":0.9,"reason":"faithful"}`, false, ""},
		{"at the threshold", `{"score":0.6,"reason":"barely"}`, false, ""},
		{"failing", `{"score":0.2,"reason":"invents a refund"}`, true, "scored it 0.20, below 0.60: invents a refund"},
		{"unreadable", `I think it is fine`, true, "not a JSON object"},
		{"out of range", `{"score":7,"reason":"great"}`, true, "not a number from 0 to 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			model := &modelsByName{answers: map[string]string{"prod": "We shipped it.", "judge": tc.verdict}}
			env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Name: "faithful",
				Judge: &onceflow.Judge{Model: "judge", Criteria: "Invents nothing.", Threshold: 0.6}}})
			env.Start()
			res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "where is my order?"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if tc.held {
				h := waitHeld(t, env, res.JobID)
				if h.Gate != "faithful" || !strings.Contains(h.Reason, tc.reason[:min(len(tc.reason), 40)]) {
					t.Fatalf("held %+v, want the reason %q", h, tc.reason)
				}
				if n := env.OutboxRows(""); n != 0 {
					t.Fatalf("%d effects of a held job", n)
				}
				if err := env.Client.Release(context.Background(), "", res.JobID, h.Key, "ops", "checked by hand"); err != nil {
					t.Fatal(err)
				}
			}
			onceflowtest.WaitFor(t, 10*time.Second, "the email", func() bool { return sink.Total() == 1 })
			if n := model.count("judge"); n != 1 {
				t.Fatalf("the judge was asked %d times, want once", n)
			}
			jr := model.lastRequest("judge")
			if !strings.Contains(jr.Messages[0].Content, "Invents nothing.") || !strings.Contains(jr.Messages[1].Content, "where is my order?") ||
				!strings.Contains(jr.Messages[1].Content, "We shipped it.") {
				t.Fatalf("the judge was asked %+v; want the criteria, the request and the answer", jr.Messages)
			}
			sink.RequireOncePerKey(t, 1)
		})
	}
}

// A hold nobody decides in time is rejected.
func TestGateHoldTimesOutRejected(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "nope"}}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Schema: objectSchema, Timeout: 300 * time.Millisecond}})
	env.Start()
	res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "x"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 15*time.Second, "the hold's timeout", func() bool {
		st, err := env.Client.JobState(context.Background(), "", res.JobID)
		return err == nil && st.Status == onceflow.StatusFailed && strings.Contains(st.Error, "nobody decided in time")
	})
	if n := env.OutboxRows("") + sink.Total(); n != 0 {
		t.Fatalf("%d effects after a hold timed out", n)
	}
}

// A released job whose first commit fails is delivered again: the release stands (no
// second hold), and its email goes out once.
func TestGateReleasedJobCommitsOnceAcrossAFailedCommit(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "free text"}}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Schema: objectSchema}})
	const key = "t-fail"
	id := onceflow.JobID(onceflow.EnqueueScope("", "test.shadowed", key))
	fault := onceflowtest.FailFirstCommit(t, env.DB, id)
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "x"}, &onceflow.EnqueueOpts{Key: key}); err != nil {
		t.Fatal(err)
	}
	h := waitHeld(t, env, id)
	if err := env.Client.Release(context.Background(), "", id, h.Key, "ops", ""); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the email", func() bool { return sink.Total() == 1 })
	if n := fault.Commits(t); n != 2 {
		t.Fatalf("%d commits tried, want 2 (the failed one and the next)", n)
	}
	if held, _ := env.Client.Inspector().Held(context.Background(), "", true, 10); len(held) != 0 {
		t.Fatalf("held again after the release: %+v", held)
	}
	sink.RequireOncePerKey(t, 1)
}

// A Config whose gates cannot work is refused at NewClient.
func TestGateConfigIsChecked(t *testing.T) {
	t.Parallel()
	rdb, prefix := onceflowtest.Redis(t)
	db, _ := onceflowtest.Postgres(t)
	for _, tc := range []struct {
		name string
		cfg  onceflow.Config
		want string
	}{
		{"no database", onceflow.Config{Gates: []onceflow.Gate{{Step: "s", Schema: objectSchema}}}, "Config.DB"},
		{"no check", onceflow.Config{DB: db, Gates: []onceflow.Gate{{Step: "s"}}}, "checks nothing"},
		{"a bad schema", onceflow.Config{DB: db, Gates: []onceflow.Gate{{Step: "s", Schema: json.RawMessage(`{"type":3}`)}}}, "schema"},
		{"no step", onceflow.Config{DB: db, Gates: []onceflow.Gate{{Schema: objectSchema}}}, "gate of step"},
		{"a judge without criteria", onceflow.Config{DB: db, Gates: []onceflow.Gate{{Step: "s", Judge: &onceflow.Judge{Model: "j"}}}}, "needs Criteria"},
		{"a judge's negative threshold", onceflow.Config{DB: db, Gates: []onceflow.Gate{{Step: "s", Judge: &onceflow.Judge{Model: "j", Criteria: "c", Threshold: -1}}}}, "between 0 and 1"},
	} {
		tc.cfg.Redis, tc.cfg.Prefix = rdb, prefix
		if _, err := onceflow.NewClient(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}

// A gate's reason with invalid UTF-8, or a character of several bytes where the record
// clips it, holds the job as any other, and Inspector.Held reports it as valid UTF-8.
func TestGateReasonWithAWideCharacterAtTheClipHoldsTheJob(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "anything"}}
	reason := "\xff" + strings.Repeat("€", 400) // invalid UTF-8, then 1,200 bytes of 3-byte characters: the clip at 1,000 falls inside one
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Check: func(*llm.Response) error { return errors.New(reason) }}})
	env.Start()
	res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "x"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := waitHeld(t, env, res.JobID)
	if !utf8.ValidString(h.Reason) || !strings.Contains(h.Reason, "\uFFFD"+strings.Repeat("€", 300)) || len(h.Reason) > 1003 {
		t.Fatalf("held with reason %q, want valid UTF-8 beginning with the gate's reason", h.Reason)
	}
	if n := env.OutboxRows("") + sink.Total(); n != 0 {
		t.Fatalf("%d effects of a held job", n)
	}
}

// A gate's reason holding U+0000 (a schema's error quotes the answer, which a model may
// fill with it), which PostgreSQL's text refuses, holds the job with U+FFFD in its place.
func TestGateReasonHoldingNULHoldsTheJob(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "anything"}}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Check: func(*llm.Response) error { return errors.New("label a\x00b is unknown") }}})
	env.Start()
	res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "x"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if h := waitHeld(t, env, res.JobID); h.Reason != "label a\uFFFDb is unknown" {
		t.Fatalf("held with reason %q, want U+FFFD for U+0000", h.Reason)
	}
	if n := env.OutboxRows("") + sink.Total(); n != 0 {
		t.Fatalf("%d effects of a held job", n)
	}
}

// Two gates of one step that both fail hold the answer once, with both reasons; one
// release lets the job go on, and its email goes out once.
func TestGatesOfOneStepHoldTogetherUnderOneDecision(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "plain text, too long"}}
	short := func(r *llm.Response) error {
		if len(r.Content) > 10 {
			return errors.New("over 10 bytes")
		}
		return nil
	}
	env, sink := gateEnv(t, model, []onceflow.Gate{{Step: "summary", Name: "structured", Schema: objectSchema},
		{Step: "summary", Name: "short", Check: short}, {Step: "summary", Name: "passes", Check: func(*llm.Response) error { return nil }}})
	env.Start()
	res, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "x"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := waitHeld(t, env, res.JobID)
	if h.Gate != "structured, short" || !strings.Contains(h.Reason, "gate structured: the answer is not JSON") ||
		!strings.Contains(h.Reason, "gate short: over 10 bytes") || strings.Contains(h.Reason, "passes") {
		t.Fatalf("held %+v; want both failing gates and their reasons", h)
	}
	if err := env.Client.Release(context.Background(), "", res.JobID, h.Key, "ops", ""); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "the email", func() bool { return sink.Total() == 1 })
	if held, _ := env.Client.Inspector().Held(context.Background(), "", true, 10); len(held) != 0 {
		t.Fatalf("held again after the release: %+v", held)
	}
	sink.RequireOncePerKey(t, 1)
}
