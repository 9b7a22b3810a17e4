package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// modelsByName answers by the request's model: answers[model], or a tool call of
// "issue_refund" for a model in toolCalls. It counts the calls per model.
type modelsByName struct {
	answers   map[string]string
	toolCalls map[string]bool
	mu        sync.Mutex
	calls     map[string]int
	last      map[string]*llm.Request // the last request per model
}

func (m *modelsByName) Complete(_ context.Context, req *llm.Request) (*llm.Response, error) {
	m.mu.Lock()
	if m.calls == nil {
		m.calls = map[string]int{}
	}
	m.calls[req.Model]++
	if m.last == nil {
		m.last = map[string]*llm.Request{}
	}
	m.last[req.Model] = req
	m.mu.Unlock()
	resp := &llm.Response{Model: req.Model, Content: m.answers[req.Model], FinishReason: llm.FinishStop,
		Usage: llm.Usage{InputTokens: 100, OutputTokens: 20}}
	if m.toolCalls[req.Model] {
		resp.Content, resp.FinishReason = "", llm.FinishToolCalls
		resp.ToolCalls = []llm.ToolCall{{ID: "call_1", Name: "issue_refund", Arguments: `{"order":"A-1"}`}}
	}
	return resp, nil
}

func (m *modelsByName) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		resp, err := m.Complete(ctx, req)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if !yield(llm.Chunk{Content: resp.Content}, nil) {
			return
		}
		yield(llm.Chunk{Done: true, FinishReason: resp.FinishReason, ToolCalls: resp.ToolCalls, Usage: &resp.Usage}, nil)
	}
}

// lastRequest is the last request model was asked.
func (m *modelsByName) lastRequest(model string) *llm.Request {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.last[model]
}

func (m *modelsByName) count(model string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.calls[model]
}

// shadowedTicket is a job with one model step, "summary", and one effect, an email.
type shadowedTicket struct {
	Text string `json:"text"`
}

func (shadowedTicket) Kind() string { return "test.shadowed" }

// shadowRun is a shadow_runs row as the tests read it.
type shadowRun struct {
	candidate, step, jobID, detail string
	agree                          bool
	candTokens                     int
}

func shadowRuns(t *testing.T, env *onceflowtest.Env) []shadowRun {
	t.Helper()
	rows, err := env.DB.Query(context.Background(), `SELECT candidate, step, job_id, detail, agree, cand_input_tokens + cand_output_tokens
FROM shadow_runs ORDER BY candidate, job_id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []shadowRun
	for rows.Next() {
		var r shadowRun
		if err := rows.Scan(&r.candidate, &r.step, &r.jobID, &r.detail, &r.agree, &r.candTokens); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

// shadowEnv runs ticket jobs whose worker calls step "summary" (streamed when stream),
// fails its first delivery after the step when failFirst, and commits one email.
func shadowEnv(t *testing.T, model llm.Client, shadows []onceflow.Shadow, stream, failFirst bool) (*onceflowtest.Env, *onceflowtest.Sink) {
	t.Helper()
	return shadowEnvWith(t, model, shadows, stream, failFirst, nil)
}

// shadowEnvWith is shadowEnv with its Config changed by tweak (when not nil).
func shadowEnvWith(t *testing.T, model llm.Client, shadows []onceflow.Shadow, stream, failFirst bool, tweak func(*onceflow.Config)) (*onceflowtest.Env, *onceflowtest.Sink) {
	t.Helper()
	sink := onceflowtest.NewSink(t)
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[shadowedTicket](func(ctx context.Context, job *onceflow.Job[shadowedTicket]) error {
		req := &llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: job.Args.Text}}}
		var answer string
		if stream {
			s := job.Stream(ctx, "summary", req)
			for ch, err := range s.All() {
				if err != nil {
					return err
				}
				answer += ch.Content
			}
		} else {
			st, err := job.Complete(ctx, "summary", req)
			if err != nil {
				return err
			}
			answer = st.Response.Content
		}
		if failFirst && job.Delivery == 1 {
			return errors.New("the first delivery fails after its model step")
		}
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Emit("email", "email:"+job.ID, map[string]string{"summary": answer})
			return nil
		})
	}))
	fast := onceflow.QueueConfig{ClaimIdle: time.Second, RetryBase: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond}
	cfg := onceflow.Config{Workers: ws, Model: model, Shadows: shadows, NoLimits: true,
		Ledger:  ledger.Config{KeepRequests: true}, // the inputs of Eval's tests
		Queues:  map[string]onceflow.QueueConfig{onceflow.DefaultQueue: fast, onceflow.ShadowQueue: fast},
		Senders: map[string]outbox.Sender{"email": sink.Sender(t, nil)}}
	if tweak != nil {
		tweak(&cfg)
	}
	env := onceflowtest.New(t, cfg)
	return env, sink
}

// Every production call of the step is shadowed on each candidate at rate 1: the
// candidate that answers alike agrees, the one that answers otherwise, or with a tool
// call, does not; the candidates' tool calls are never run, and the job's effects are
// production's only. A redelivered job replays its step and enqueues no second shadow.
func TestShadowRunsBesideProductionWithoutEffects(t *testing.T) {
	t.Parallel()
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "complete", true: "stream"}[stream], func(t *testing.T) {
			t.Parallel()
			model := &modelsByName{answers: map[string]string{"prod": "The order shipped.", "same": "The order shipped. ", "other": "It did not ship."},
				toolCalls: map[string]bool{"tooly": true}}
			env, sink := shadowEnv(t, model, []onceflow.Shadow{
				{Step: "summary", Model: "same", Rate: 1},
				{Step: "summary", Model: "other", Rate: 1},
				{Step: "summary", Model: "tooly", Rate: 1},
				{Step: "another-step", Model: "other", Rate: 1},
			}, stream, true)
			env.Start()
			ctx := context.Background()
			const jobs = 3
			for i := range jobs {
				if _, err := env.Client.Enqueue(ctx, shadowedTicket{Text: fmt.Sprint("ticket ", i)}, nil); err != nil {
					t.Fatal(err)
				}
			}
			onceflowtest.WaitFor(t, 20*time.Second, "every shadow recorded", func() bool {
				return env.Count(`SELECT count(*) FROM shadow_runs`) == 3*jobs && sink.Total() == jobs
			})
			time.Sleep(200 * time.Millisecond) // time for a second shadow of a call to show, were one enqueued
			runs := shadowRuns(t, env)
			if len(runs) != 3*jobs {
				t.Fatalf("%d shadow runs, want %d", len(runs), 3*jobs)
			}
			for _, r := range runs {
				want := r.candidate == "same"
				if r.agree != want || r.step != "summary" || r.candTokens != 120 || (r.agree != (r.detail == "")) {
					t.Errorf("shadow run %+v: agree %v, want %v, step summary, 120 tokens", r, r.agree, want)
				}
			}
			if got := model.count("prod"); got != jobs {
				t.Errorf("production called %d times, want %d (the redelivery replays the step)", got, jobs)
			}
			for _, cand := range []string{"same", "other", "tooly"} {
				if got := model.count(cand); got != jobs {
					t.Errorf("candidate %s called %d times, want %d: once per production call", cand, got, jobs)
				}
			}
			if n := env.OutboxRows(""); n != jobs || onceflowtest.Completions(t, env.DB, "test.shadowed") != jobs {
				t.Fatalf("%d outbox rows, want %d: production's emails only", n, jobs)
			}
			sink.RequireOncePerKey(t, jobs)
		})
	}
}

// A shadow job whose commit fails after the candidate answered is delivered again: the
// candidate's answer is replayed from the ledger (not paid twice) and the run recorded
// once.
func TestShadowRunIsRecordedOnceAcrossAFailedCommit(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "yes", "cand": "no"}}
	env, sink := shadowEnv(t, model, []onceflow.Shadow{{Step: "summary", Model: "cand", Name: "candidate-a", Rate: 1}}, false, false)
	const key = "ticket-1"
	jobID := onceflow.JobID(onceflow.EnqueueScope("", "test.shadowed", key))
	req := llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: "the ticket"}}}
	req.IdempotencyKey = ledger.Work(jobID, "summary")
	prodKey := ledger.Key(req.IdempotencyKey, &req)
	shadowJob := onceflow.JobID(onceflow.EnqueueScopeOn(onceflow.ShadowQueue, "", onceflow.ShadowKind, "shadow:candidate-a:"+prodKey))
	fault := onceflowtest.FailFirstCommit(t, env.DB, shadowJob)
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "the ticket"}, &onceflow.EnqueueOpts{Key: key}); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the shadow recorded", func() bool { return env.Count(`SELECT count(*) FROM shadow_runs`) == 1 })
	if n := fault.Commits(t); n != 2 {
		t.Fatalf("the shadow job's commit was tried %d times, want 2 (the failed one and the next)", n)
	}
	if got := model.count("cand"); got != 1 {
		t.Fatalf("the candidate was called %d times, want 1: the redelivery replays its answer", got)
	}
	runs := shadowRuns(t, env)
	if len(runs) != 1 || runs[0].jobID != jobID || runs[0].candidate != "candidate-a" || runs[0].agree {
		t.Fatalf("shadow runs %+v", runs)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "production's email", func() bool { return sink.Total() == 1 })
}

// A shadow graded by a judge records the judge's score and reason, agreeing when the
// score reaches the threshold. The judge is asked once per shadow, with both answers
// and the request, even when the shadow job's commit fails and it is delivered again
// (its verdict is replayed from the ledger).
func TestShadowJudgeGradesAgreementOnceAcrossAFailedCommit(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "The order shipped on Monday.", "cand": "It shipped Monday.",
		"judge": "```json\n{\"score\": 0.8, \"reason\": \"the same date, shorter\"}\n```", "harsh": `{"score":0.8,"reason":"too short"}`}}
	env, sink := shadowEnv(t, model, []onceflow.Shadow{
		{Step: "summary", Model: "cand", Rate: 1, Judge: &onceflow.Judge{Model: "judge"}},
		{Step: "summary", Model: "cand", Name: "cand-strict", Rate: 1, Judge: &onceflow.Judge{Model: "harsh", Threshold: 0.9, Criteria: "Exactly the same facts."}},
	}, false, false)
	const key = "judged"
	jobID := onceflow.JobID(onceflow.EnqueueScope("", "test.shadowed", key))
	req := llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: "when did it ship?"}}}
	req.IdempotencyKey = ledger.Work(jobID, "summary")
	shadowJob := onceflow.JobID(onceflow.EnqueueScopeOn(onceflow.ShadowQueue, "", onceflow.ShadowKind, "shadow:cand:"+ledger.Key(req.IdempotencyKey, &req)))
	fault := onceflowtest.FailFirstCommit(t, env.DB, shadowJob)
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "when did it ship?"}, &onceflow.EnqueueOpts{Key: key}); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "both shadows recorded", func() bool { return env.Count(`SELECT count(*) FROM shadow_runs`) == 2 })
	if n := fault.Commits(t); n != 2 {
		t.Fatalf("the judged shadow's commit was tried %d times, want 2", n)
	}
	if j, h := model.count("judge"), model.count("harsh"); j != 1 || h != 1 {
		t.Fatalf("judges asked %d and %d times, want once each: a redelivery replays the verdict", j, h)
	}
	var score float64
	var agree bool
	var detail string
	if err := env.DB.QueryRow(context.Background(), `SELECT score, agree, detail FROM shadow_runs WHERE candidate = 'cand'`).Scan(&score, &agree, &detail); err != nil {
		t.Fatal(err)
	}
	if score != 0.8 || !agree || detail != "the same date, shorter" {
		t.Fatalf("judged run: score %v agree %v detail %q; want 0.8, agreeing at the default threshold 0.7", score, agree, detail)
	}
	if err := env.DB.QueryRow(context.Background(), `SELECT score, agree FROM shadow_runs WHERE candidate = 'cand-strict'`).Scan(&score, &agree); err != nil {
		t.Fatal(err)
	}
	if score != 0.8 || agree {
		t.Fatalf("strictly judged run: score %v agree %v; want 0.8, disagreeing below 0.9", score, agree)
	}
	jr := model.lastRequest("harsh")
	if len(jr.Messages) != 2 || !strings.Contains(jr.Messages[0].Content, "Exactly the same facts.") ||
		!strings.Contains(jr.Messages[1].Content, "when did it ship?") || !strings.Contains(jr.Messages[1].Content, "The order shipped on Monday.") ||
		!strings.Contains(jr.Messages[1].Content, "It shipped Monday.") {
		t.Fatalf("the judge was asked %+v; want the criteria, the request and both answers", jr.Messages)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "production's email", func() bool { return sink.Total() == 1 })
}

// A rate samples the production calls by a hash of the job: the same jobs every time,
// in about the share asked.
func TestShadowRateSamplesByJob(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "yes", "cand": "yes"}}
	env, sink := shadowEnv(t, model, []onceflow.Shadow{{Step: "summary", Model: "cand", Rate: 0.25}}, false, false)
	env.Start()
	const jobs = 80
	for i := range jobs {
		if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: fmt.Sprint("t", i)}, &onceflow.EnqueueOpts{Key: fmt.Sprint("k", i)}); err != nil {
			t.Fatal(err)
		}
	}
	onceflowtest.WaitFor(t, 30*time.Second, "every email", func() bool { return sink.Total() == jobs })
	onceflowtest.WaitFor(t, 10*time.Second, "the shadow queue drained", func() bool {
		return onceflowtest.Pending(t, env.Redis, env.Prefix, onceflow.ShadowQueue) == 0 && env.Count(`SELECT count(*) FROM shadow_runs`) == model.count("cand")
	})
	n := env.Count(`SELECT count(*) FROM shadow_runs`)
	if n < jobs/10 || n > jobs/2 {
		t.Fatalf("%d of %d calls shadowed at rate 0.25", n, jobs)
	}
}

// ONCEFLOW_SHADOW's entries, and what it refuses.
func TestParseShadowsReadsEntriesAndRefusesBadOnes(t *testing.T) {
	got, err := onceflow.ParseShadows(" summary=gpt-4.1-nano@0.25, agent.turn-1=claude-haiku-4-5@1 ,")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal([]any{got[0].Step, got[0].Model, got[0].Rate, got[1].Step, got[1].Model, got[1].Rate})
	if len(got) != 2 || string(b) != `["summary","gpt-4.1-nano",0.25,"agent.turn-1","claude-haiku-4-5",1]` {
		t.Fatalf("parsed %s", b)
	}
	if got, err := onceflow.ParseShadows(""); err != nil || len(got) != 0 {
		t.Fatalf("empty: %v %v", got, err)
	}
	for _, bad := range []string{"summary", "summary=m", "summary=m@x", "summary=m@1.5", "summary=m@-0.1", "=m@0.5", "summary=@0.5", "summary=m@NaN"} {
		if _, err := onceflow.ParseShadows(bad); err == nil || !strings.Contains(err.Error(), "shadow") {
			t.Errorf("%q: %v, want an error naming the shadow", bad, err)
		}
	}
}

// A model whose name holds "@" (Vertex AI's "claude-sonnet-4@20250514") is read whole:
// the rate is what follows the last "@".
func TestParseShadowsReadsAModelNamedWithAnAt(t *testing.T) {
	got, err := onceflow.ParseShadows("summary=claude-sonnet-4@20250514@0.5")
	if err != nil || len(got) != 1 || got[0].Model != "claude-sonnet-4@20250514" || got[0].Rate != 0.5 {
		t.Fatalf("parsed %+v, %v; want the model claude-sonnet-4@20250514 at 0.5", got, err)
	}
}

// A Config whose shadows cannot run is refused at NewClient, naming the shadow.
func TestShadowConfigIsChecked(t *testing.T) {
	t.Parallel()
	rdb, prefix := onceflowtest.Redis(t)
	db, _ := onceflowtest.Postgres(t)
	model := &modelsByName{}
	for _, tc := range []struct {
		name string
		cfg  onceflow.Config
		want string
	}{
		{"no model", onceflow.Config{DB: db, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 1}}}, "Config.Model"},
		{"no database", onceflow.Config{Model: model, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 1}}}, "Config.DB"},
		{"no candidate", onceflow.Config{DB: db, Model: model, Shadows: []onceflow.Shadow{{Step: "s", Rate: 1}}}, "neither a Model nor a Transform"},
		{"a candidate twice", onceflow.Config{DB: db, Model: model, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 1}, {Step: "s", Model: "m", Rate: 0.5}}}, "twice"},
		{"a bad rate", onceflow.Config{DB: db, Model: model, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 2}}}, "want 0 to 1"},
		{"a judge without a model", onceflow.Config{DB: db, Model: model, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 1, Judge: &onceflow.Judge{}}}}, "Model is required"},
		{"a judge and a comparator", onceflow.Config{DB: db, Model: model, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 1,
			Judge: &onceflow.Judge{Model: "j"}, Compare: onceflow.ExactMatch}}}, "not both"},
		{"a judge's threshold over 1", onceflow.Config{DB: db, Model: model, Shadows: []onceflow.Shadow{{Step: "s", Model: "m", Rate: 1,
			Judge: &onceflow.Judge{Model: "j", Threshold: 1.5}}}}, "between 0 and 1"},
	} {
		tc.cfg.Redis, tc.cfg.Prefix = rdb, prefix
		if _, err := onceflow.NewClient(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}

// ExactMatch and JSONFieldsMatch.
func TestShadowComparators(t *testing.T) {
	r := func(content string, calls ...llm.ToolCall) *llm.Response {
		return &llm.Response{Content: content, ToolCalls: calls}
	}
	call := func(id, args string) llm.ToolCall { return llm.ToolCall{ID: id, Name: "refund", Arguments: args} }
	for _, tc := range []struct {
		name string
		got  onceflow.Comparison
		want bool
	}{
		{"same text", onceflow.ExactMatch(r("yes"), r(" yes\n")), true},
		{"other text", onceflow.ExactMatch(r("yes"), r("no")), false},
		{"same call, other id and key order", onceflow.ExactMatch(r("", call("a", `{"x":1,"y":2}`)), r("", call("b", `{"y":2,"x":1}`))), true},
		{"other arguments", onceflow.ExactMatch(r("", call("a", `{"x":1}`)), r("", call("a", `{"x":2}`))), false},
		{"a call missing", onceflow.ExactMatch(r("", call("a", `{}`)), r("")), false},
		{"fields alike", onceflow.JSONFieldsMatch("label", "n")(r(`{"label":"bug","n":1,"why":"a"}`), r(`{"n":1.0,"label":"bug","why":"b"}`)), true},
		{"a field differs", onceflow.JSONFieldsMatch("label", "n")(r(`{"label":"bug","n":1}`), r(`{"label":"feature","n":1}`)), false},
		{"not JSON", onceflow.JSONFieldsMatch("label")(r(`{"label":"bug"}`), r(`bug`)), false},
	} {
		if tc.got.Agree != tc.want || (tc.want && tc.got.Score != 1) || (!tc.want && tc.got.Detail == "") {
			t.Errorf("%s: %+v, want agree %v", tc.name, tc.got, tc.want)
		}
	}
	if s := onceflow.JSONFieldsMatch("a", "b")(r(`{"a":1,"b":2}`), r(`{"a":1,"b":3}`)).Score; s != 0.5 {
		t.Errorf("one field of two alike: score %v, want 0.5", s)
	}
}

// ParseShadows takes any text without panicking, and what it accepts has rates in [0, 1]
// and names of printable ASCII.
func FuzzParseShadows(f *testing.F) {
	for _, s := range []string{"summary=gpt-4.1-nano@0.25", "a=b@1,c=d@0", "x=y@1e-3", "=@", "a=b@c@d"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := onceflow.ParseShadows(s)
		if err != nil {
			return
		}
		for _, sh := range got {
			if sh.Rate < 0 || sh.Rate > 1 || sh.Step == "" || sh.Model == "" {
				t.Fatalf("%q parsed to %+v", s, sh)
			}
		}
	})
}

// Answers holding U+0000, which PostgreSQL's jsonb and text refuse (production's, the
// candidate's and the judge's reason alike), are recorded with U+FFFD in its place: the
// shadow run is recorded.
func TestShadowRunOfAnswersHoldingNULIsRecorded(t *testing.T) {
	t.Parallel()
	model := &modelsByName{answers: map[string]string{"prod": "ship\x00ped", "cand": "not\x00yet",
		"judge": `{"score":0.1,"reason":"B says\u0000the opposite"}`}}
	env, sink := shadowEnv(t, model, []onceflow.Shadow{
		{Step: "summary", Model: "cand", Rate: 1},
		{Step: "summary", Model: "cand", Name: "judged", Rate: 1, Judge: &onceflow.Judge{Model: "judge"}},
	}, false, false)
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "shipped?"}, nil); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "both shadows recorded", func() bool { return env.Count(`SELECT count(*) FROM shadow_runs`) == 2 })
	if n := env.Count(`SELECT count(*) FROM shadow_runs WHERE detail = 'B says` + "\uFFFD" + `the opposite'
	AND prod_answer->>'content' = 'ship` + "\uFFFD" + `ped' AND cand_answer->>'content' = 'not` + "\uFFFD" + `yet'`); n != 1 {
		t.Fatalf("%d judged runs with U+FFFD for U+0000 in both answers and the reason, want 1", n)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "production's email", func() bool { return sink.Total() == 1 })
}

// A redelivered job replays its step and finds its shadows enqueued by the delivery
// that made the call (the replay measures another latency): that is no failure, and
// nothing is logged as one.
func TestShadowOfAReplayedStepIsNotReportedAsDropped(t *testing.T) {
	t.Parallel()
	var logs testenv.SyncBuffer
	model := &modelsByName{answers: map[string]string{"prod": "yes", "cand": "no"}}
	env, sink := shadowEnvWith(t, model, []onceflow.Shadow{{Step: "summary", Model: "cand", Rate: 1}}, false, true, func(cfg *onceflow.Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "the ticket"}, nil); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "production's email and the shadow run", func() bool {
		return sink.Total() == 1 && env.Count(`SELECT count(*) FROM shadow_runs`) == 1
	})
	if strings.Contains(logs.String(), "not enqueued") {
		t.Fatalf("the redelivery reported its shadow dropped:\n%s", logs.String())
	}
}

// failingModel answers 503 to every request for model down, and passes the others on.
type failingModel struct {
	*modelsByName
	down     string
	failures atomic.Int64
}

func (m *failingModel) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	if req.Model == m.down {
		m.failures.Add(1)
		return nil, &llm.APIError{Provider: "test", StatusCode: 503, Type: "server_error", Message: "the model is overloaded"}
	}
	return m.modelsByName.Complete(ctx, req)
}

// A candidate whose calls fail says nothing of production's model: its failures open
// no breaker (production goes on taking jobs), and its shadow job spends its deliveries
// and is dead-lettered.
func TestShadowOfAFailingCandidateLeavesProductionsBreakerClosed(t *testing.T) {
	t.Parallel()
	model := &failingModel{modelsByName: &modelsByName{answers: map[string]string{"prod": "yes"}}, down: "cand"}
	env, sink := shadowEnvWith(t, model, []onceflow.Shadow{{Step: "summary", Model: "cand", Rate: 1}}, false, false, func(cfg *onceflow.Config) {
		cfg.BreakerThreshold = 2
		cfg.ModelRetry = retry.Policy{MaxAttempts: 1}
		q := cfg.Queues[onceflow.ShadowQueue]
		q.MaxDeliveries = 3
		cfg.Queues[onceflow.ShadowQueue] = q
	})
	const key = "ticket-1"
	jobID := onceflow.JobID(onceflow.EnqueueScope("", "test.shadowed", key))
	req := llm.Request{Model: "prod", Messages: []llm.Message{{Role: llm.RoleUser, Content: "the ticket"}}}
	req.IdempotencyKey = ledger.Work(jobID, "summary")
	shadowJob := onceflow.JobID(onceflow.EnqueueScopeOn(onceflow.ShadowQueue, "", onceflow.ShadowKind, "shadow:cand:"+ledger.Key(req.IdempotencyKey, &req)))
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "the ticket"}, &onceflow.EnqueueOpts{Key: key}); err != nil {
		t.Fatal(err)
	}
	llmb := breakerOf(t, env.Client, "llm")
	onceflowtest.WaitFor(t, 10*time.Second, "the shadow dead-lettered", func() bool {
		if err := llmb.Err(); err != nil {
			t.Fatalf("the candidate's failures opened production's breaker: %v", err)
		}
		st, err := env.Client.JobState(context.Background(), "", shadowJob)
		return err == nil && st.Status == onceflow.StatusFailed
	})
	if n := model.failures.Load(); n != 3 {
		t.Fatalf("the candidate was asked %d times, want 3 (one per delivery)", n)
	}
	onceflowtest.WaitFor(t, 10*time.Second, "production's email", func() bool { return sink.Total() == 1 })
}

// A shadow run carries production's answer out of the delivery (a job in Redis): the
// answer is recorded durably before the shadow is enqueued, not left to a later
// commit's flush, although the step's own context defers its writes' flushes.
func TestShadowedAnswerIsDurableBeforeItsShadowIsEnqueued(t *testing.T) {
	t.Parallel()
	pg := &roundtrip.Commits{Only: func(sql string) bool { return strings.Contains(sql, "llm_calls") && !strings.Contains(sql, "DELETE") }}
	model := &modelsByName{answers: map[string]string{"prod": "The order shipped.", "same": "The order shipped."}}
	env, sink := shadowEnvWith(t, model, []onceflow.Shadow{{Step: "summary", Model: "same", Rate: 1}}, false, false,
		func(c *onceflow.Config) { c.DB = commitCountedPool(t, pg) })
	env.Start()
	if _, err := env.Client.Enqueue(context.Background(), shadowedTicket{Text: "ticket 1"}, nil); err != nil {
		t.Fatal(err)
	}
	onceflowtest.WaitFor(t, 20*time.Second, "the shadow recorded", func() bool {
		return env.Count(`SELECT count(*) FROM shadow_runs`) == 1 && sink.Total() == 1
	})
	if n := pg.Relaxed(); n != 0 {
		t.Fatalf("%d ledger writes committed without waiting for their flush, want 0: production's answer left the delivery in a shadow job before it was durable", n)
	}
}
