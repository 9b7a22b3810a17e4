package summaries_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
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

// The crash tests of docs/RELIABILITY.md, against real Redis and PostgreSQL, each counting the effects:
// model calls, summaries, outbox rows and emails delivered to a webhook sink. Where a
// process dies it is a real `onceflow work` or `onceflow relay` killed with SIGKILL.

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

// run is one handler run: its outcome and error, and the delivery it was.
type run struct {
	outcome    summaries.Outcome
	err        error
	deliveries int64
	at         time.Time
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

// gatedModel is llm/fakeserver over HTTP that holds every chat completion until release
// is closed (or the client goes away), and counts and reports each arrival.
type gatedModel struct {
	fake     *fakeserver.Server
	requests atomic.Int64
	arrived  chan struct{}
	release  chan struct{}
	once     sync.Once
}

func newGatedModel(t *testing.T) (*gatedModel, *httptest.Server) {
	t.Helper()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedModel{fake: fs, arrived: make(chan struct{}, 100), release: make(chan struct{})}
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	t.Cleanup(g.Release) // before srv.Close: handlers must return for Close to return
	return g, srv
}

func (g *gatedModel) Release() { g.once.Do(func() { close(g.release) }) }

func (g *gatedModel) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/chat/completions" {
		g.requests.Add(1)
		g.arrived <- struct{}{}
		select {
		case <-g.release:
		case <-r.Context().Done():
			return
		}
	}
	g.fake.ServeHTTP(w, r)
}

// await waits for the next model request to arrive.
func (g *gatedModel) await(t *testing.T, timeout time.Duration) {
	t.Helper()
	select {
	case <-g.arrived:
	case <-time.After(timeout):
		t.Fatalf("no model request within %v", timeout)
	}
}

// A worker commits the summary and its outbox row and is killed (kill -9) before its XACK:
// the entry stays pending; a second worker reclaims it, the pre-check finds the summary
// and skips the model. One model call, one summary, one outbox row, and one email after
// two relay passes.
//
// The kill must fall between the commit and the XACK. To put it there without racing, the
// worker runs against a Redis of the test's own whose writes the test pauses (CLIENT
// PAUSE WRITE) while the worker waits for the model: the worker then commits to PostgreSQL
// and blocks on its XACK, and is killed once its commit is visible.
func TestCrashBetweenCommitAndXACK(t *testing.T) {
	t.Parallel()
	srvRedis := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srvRedis))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	p := newPipelineOn(t, rdb, "onceflow")
	model, modelSrv := newGatedModel(t)
	ctx := context.Background()

	const jobID = "00000000-0000-4000-8000-00000000c0a1"
	p.enqueue(jobID, "Incident review: the deploy at 14:02 caused the outage.")
	a := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURLOf(srvRedis), "ONCEFLOW_DATABASE_URL=" + p.dsn,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + modelSrv.URL + "/v1", "OPENAI_API_KEY=test-key",
	}, "work")
	model.await(t, 20*time.Second) // worker a read the job and passed the pre-check
	if err := rdb.Do(ctx, "CLIENT", "PAUSE", "60000", "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	unpaused := false
	unpause := func() {
		if !unpaused {
			unpaused = true
			if err := rdb.Do(ctx, "CLIENT", "UNPAUSE").Err(); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(unpause)
	model.Release()
	testenv.WaitFor(t, 20*time.Second, "worker a's commit", func() bool {
		return count(t, p.pool, `SELECT count(*) FROM summaries WHERE job_id = $1`, jobID) == 1
	})
	a.Kill() // its XACK is still waiting for the paused Redis
	unpause()
	ps := p.pending()
	if len(ps) != 1 || ps[0].RetryCount != 1 {
		t.Fatalf("after the kill: pending %+v, want the job pending once, to worker a", ps)
	}
	if n := count(t, p.pool, `SELECT count(*) FROM outbox`); n != 1 {
		t.Fatalf("worker a committed %d outbox rows, want 1 with its summary", n)
	}

	// Worker b reclaims the entry and acknowledges it without calling the model.
	client := fake.New()
	b := &recorder{h: newHandler(t, p.pool, client, handlerConfig{})}
	stop := startWorker(t, queue.WorkerConfig{Redis: rdb, Keys: p.keys, Handler: b, ClaimIdle: 300 * time.Millisecond})
	testenv.WaitFor(t, 20*time.Second, "the reclaimed entry to be acknowledged", func() bool { return len(p.pending()) == 0 })
	stop()
	if runs := b.Runs(); len(runs) != 1 || runs[0].outcome != summaries.OutcomeDuplicate || runs[0].err != nil || runs[0].deliveries != 2 {
		t.Fatalf("worker b's runs %+v, want one duplicate on delivery 2", runs)
	}

	relay := p.relay(outbox.Config{})
	if r := p.pass(relay); r.Sent != 1 {
		t.Fatalf("first relay pass %+v, want one sent", r)
	}
	if r := p.pass(relay); r.Claimed != 0 {
		t.Fatalf("second relay pass %+v, want nothing to claim", r)
	}
	if calls := model.requests.Load() + int64(client.Calls()); calls != 1 {
		t.Fatalf("%d model calls, want 1: the pre-check skipped the model on redelivery", calls)
	}
	p.effects(jobID, 1, 1, 1)
}

// The same job id enqueued twice (the API crashing after XADD, docs/queue.md): the
// second delivery finds the summary. One model call, one summary, one email.
func TestSameJobEnqueuedTwice(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	const jobID = "00000000-0000-4000-8000-0000000000d2"
	p.enqueue(jobID, "Two deliveries of one job.")
	p.enqueue(jobID, "Two deliveries of one job.")
	client := fake.New()
	rec := &recorder{h: newHandler(t, p.pool, client, handlerConfig{})}
	// One at a time, so the second delivery runs after the first committed: the pre-check
	// then saves its model call. (Run at once, both would call the model and the primary
	// key would still let only one store: see TestSlowWorkerAndReclaimer.)
	stop := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: rec, Concurrency: 1})
	testenv.WaitFor(t, 20*time.Second, "both deliveries", func() bool { return len(rec.Runs()) == 2 && len(p.pending()) == 0 })
	stop()
	runs := rec.Runs()
	if runs[0].outcome != summaries.OutcomeDone || runs[1].outcome != summaries.OutcomeDuplicate || runs[0].err != nil || runs[1].err != nil {
		t.Fatalf("runs %+v, want done then duplicate", runs)
	}
	relay := p.relay(outbox.Config{})
	p.pass(relay)
	p.pass(relay)
	if client.Calls() != 1 {
		t.Fatalf("%d model calls, want 1", client.Calls())
	}
	p.effects(jobID, 1, 1, 1)
}

// gatedClient is an llm.Client that holds every call until release is closed.
type gatedClient struct {
	*fake.Client
	arrived chan struct{}
	release chan struct{}
}

func (g *gatedClient) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	g.arrived <- struct{}{}
	select {
	case <-g.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.Client.Complete(ctx, req)
}

// A slow worker and a reclaimer on one job: worker a is still waiting for the model when
// its entry has been idle for ClaimIdle (no lease renewal), so worker b reclaims it and
// runs the job too. Both pay for a model call; the summaries primary key lets only b
// store, and only the winner writes the outbox row: results done and duplicate, two model
// calls, one summary, one email.
func TestSlowWorkerAndReclaimer(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	const jobID = "00000000-0000-4000-8000-0000000000e3"
	p.enqueue(jobID, "A slow model call.")

	slow := &gatedClient{Client: fake.New(), arrived: make(chan struct{}, 1), release: make(chan struct{})}
	t.Cleanup(func() {
		select {
		case <-slow.release:
		default:
			close(slow.release)
		}
	})
	a := &recorder{h: newHandler(t, p.pool, slow, handlerConfig{})}
	stopA := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: a, Consumer: "worker-a",
		ClaimIdle: time.Hour, RenewInterval: -1})
	select {
	case <-slow.arrived:
	case <-time.After(20 * time.Second):
		t.Fatal("worker a never called the model")
	}

	quick := fake.New()
	b := &recorder{h: newHandler(t, p.pool, quick, handlerConfig{})}
	stopB := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: b, Consumer: "worker-b",
		ClaimIdle: 300 * time.Millisecond, RenewInterval: -1})
	testenv.WaitFor(t, 20*time.Second, "worker b to reclaim and finish the job", func() bool { return len(b.Runs()) == 1 })
	close(slow.release)
	testenv.WaitFor(t, 20*time.Second, "worker a to finish", func() bool { return len(a.Runs()) == 1 })
	stopA()
	stopB()

	ra, rb := a.Runs()[0], b.Runs()[0]
	if rb.outcome != summaries.OutcomeDone || rb.deliveries != 2 || ra.outcome != summaries.OutcomeDuplicate || ra.err != nil || rb.err != nil {
		t.Fatalf("worker a %+v, worker b %+v; want b done on delivery 2, a duplicate", ra, rb)
	}
	if n := len(p.pending()); n != 0 {
		t.Fatalf("%d entries pending, want 0", n)
	}
	// Two model calls: each delivery passed the pre-check before either stored. This is
	// the handler without the llm_calls ledger. The service runs the handler WITH
	// the ledger (cli.deps.clientConfig), and then this case makes ONE model call: the
	// reclaimer finds the slow worker's call in flight, waits for it and replays its
	// answer (TestSlowWorkerAndReclaimerMakeOneModelCallWithTheLedger in ledger_test.go).
	if calls := slow.Calls() + quick.Calls(); calls != 2 {
		t.Fatalf("%d model calls, want 2", calls)
	}
	relay := p.relay(outbox.Config{})
	p.pass(relay)
	p.pass(relay)
	p.effects(jobID, 1, 1, 1)
}

// A consumer killed (kill -9) after XREADGROUP, while its model call runs: the entry is
// not claimable before ClaimIdle, and afterwards another worker claims it as delivery 2
// and finishes the job. One summary, one outbox row, one email.
func TestConsumerKilledAfterXREADGROUP(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	model, modelSrv := newGatedModel(t)
	ctx := context.Background()
	const claimIdle = 2 * time.Second
	const jobID = "00000000-0000-4000-8000-0000000000f4"
	p.enqueue(jobID, "Killed mid-job.")
	a := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + p.dsn, "ONCEFLOW_PREFIX=" + p.keys.Prefix,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + modelSrv.URL + "/v1", "OPENAI_API_KEY=test-key",
		"ONCEFLOW_CLAIM_IDLE=" + claimIdle.String(),
	}, "work")
	model.await(t, 20*time.Second)
	a.Kill()
	killed := time.Now()
	ps := p.pending()
	if len(ps) != 1 || ps[0].RetryCount != 1 {
		t.Fatalf("after the kill: pending %+v, want the job pending once", ps)
	}
	idleAtKill := ps[0].Idle

	// Not claimable before ClaimIdle: a claim asking for that idle time gets nothing.
	msgs, _, err := p.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: p.keys.Stream(), Group: queue.DefaultGroup,
		Consumer: "probe", MinIdle: claimIdle, Start: "0-0", Count: 10}).Result()
	if err != nil || len(msgs) != 0 {
		t.Fatalf("claim before ClaimIdle: %v %v, want nothing", msgs, err)
	}

	client := fake.New()
	b := &recorder{h: newHandler(t, p.pool, client, handlerConfig{})}
	stop := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: b, ClaimIdle: claimIdle})
	testenv.WaitFor(t, 30*time.Second, "worker b to finish the job", func() bool { return len(b.Runs()) == 1 && len(p.pending()) == 0 })
	stop()
	r := b.Runs()[0]
	if r.outcome != summaries.OutcomeDone || r.err != nil || r.deliveries != 2 {
		t.Fatalf("worker b's run %+v, want done on delivery 2", r)
	}
	if earliest := killed.Add(claimIdle - idleAtKill - 100*time.Millisecond); r.at.Before(earliest) {
		t.Fatalf("reclaimed at %v, before the entry could have been idle for ClaimIdle (%v)", r.at, earliest)
	}
	if n := model.requests.Load(); n != 1 || client.Calls() != 1 {
		t.Fatalf("model calls: %d by worker a, %d by worker b; want 1 and 1", n, client.Calls())
	}
	relay := p.relay(outbox.Config{})
	p.pass(relay)
	p.pass(relay)
	p.effects(jobID, 1, 1, 1)
}

// fastRetries keeps a delivery's four attempts quick: the fake's Retry-After (1s) is
// capped to a few milliseconds, as is the jitter.
var fastRetries = retry.Policy{Base: time.Millisecond, Cap: 5 * time.Millisecond, RetryAfterCap: 5 * time.Millisecond}

// openAIModel returns the real OpenAI adapter pointed at llm/fakeserver over HTTP.
func openAIModel(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, llm.Client) {
	t.Helper()
	cfg.Logger = testenv.Logger(t)
	fs, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(fs)
	t.Cleanup(srv.Close)
	t.Cleanup(fs.Close)
	return fs, openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"})
}

// A model that answers 429 forever: four attempts within the delivery (the same
// Idempotency-Key each time), then the job leaves the worker for its next attempt (in
// the scheduled set, or back in the stream when the backoff drew 0), not dead-lettered.
func Test429Forever(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	fs, client := openAIModel(t, fakeserver.Config{Fail429: 1})
	const jobID = "00000000-0000-4000-8000-000000000429"
	p.enqueue(jobID, "Rate limited.")
	rec := &recorder{h: newHandler(t, p.pool, client, handlerConfig{Retry: fastRetries})}
	stop := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: rec})
	testenv.WaitFor(t, 20*time.Second, "the delivery to end", func() bool { return len(rec.Runs()) == 1 })
	stop()

	r := rec.Runs()[0]
	var apiErr *llm.APIError
	if r.err == nil || errors.Is(r.err, retry.ErrPermanent) || !retry.Transient(r.err) || !errors.As(r.err, &apiErr) || apiErr.StatusCode != 429 {
		t.Fatalf("run %+v, want a transient 429 error", r)
	}
	st := fs.Stats()
	if st.Requests != 4 || st.ByStatus["429"] != 4 || st.ByIdempotencyKey["summary:"+jobID] != 4 {
		t.Fatalf("fake-llm saw %+v, want 4 requests, all 429, all with the job's key", st)
	}
	if ps := p.pending(); len(ps) != 0 {
		t.Fatalf("pending %+v, want the job released for its next attempt", ps)
	}
	if d := p.dead(jobID); len(d) != 0 {
		t.Fatalf("dead letters %+v, want none", d)
	}
	ctx := context.Background()
	_, state, _, err := queue.JobState(ctx, p.rdb, p.keys, jobID)
	scheduled := p.rdb.ZCard(ctx, p.keys.Scheduled()).Val()
	if err != nil || !(state == queue.StateScheduled && scheduled == 1 || state == queue.StateQueued && scheduled == 0) {
		t.Fatalf("job state %q (%v) with %d scheduled, want scheduled for its next attempt (or queued again)", state, err, scheduled)
	}
	p.effects(jobID, 0, 0, 0)
}

// A 400 context_length_exceeded is permanent: one model call, then the dead letter with
// the provider's reason, no summary and no email.
func TestContextLength400IsDeadLetteredAfterOneCall(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	fs, client := openAIModel(t, fakeserver.Config{MaxInputChars: 200})
	const jobID = "00000000-0000-4000-8000-000000000400"
	p.enqueue(jobID, strings.Repeat("far too long ", 50))
	rec := &recorder{h: newHandler(t, p.pool, client, handlerConfig{Retry: fastRetries})}
	stop := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: rec})
	testenv.WaitFor(t, 20*time.Second, "the dead letter", func() bool { return len(p.dead(jobID)) == 1 })
	stop()

	if r := rec.Runs(); len(r) != 1 || !errors.Is(r[0].err, retry.ErrPermanent) {
		t.Fatalf("runs %+v, want one permanent failure", r)
	}
	if st := fs.Stats(); st.Requests != 1 || st.ByStatus["400"] != 1 {
		t.Fatalf("fake-llm saw %+v, want one request answered 400", st)
	}
	d := p.dead(jobID)[0]
	if !strings.Contains(d.Reason, "permanent") || !strings.Contains(d.Reason, "context_length_exceeded") || d.Deliveries != 1 {
		t.Fatalf("dead letter %+v", d)
	}
	if ps := p.pending(); len(ps) != 0 {
		t.Fatalf("pending %+v, want none", ps)
	}
	if _, state, reason, _ := queue.JobState(context.Background(), p.rdb, p.keys, jobID); state != queue.StateFailed || reason != d.Reason {
		t.Fatalf("job state %q %q, want failed with the dead-letter reason", state, reason)
	}
	p.effects(jobID, 0, 0, 0)
}

// process runs the handler on a job directly, as one delivery, to write its outbox row.
func (p *pipeline) process(m queue.Message) {
	p.t.Helper()
	h := newHandler(p.t, p.pool, fake.New(), handlerConfig{})
	if o, err := h.Process(context.Background(), &queue.Job{Message: m, ID: "1-1", Deliveries: 1}); err != nil || o != summaries.OutcomeDone {
		p.t.Fatalf("process: %v %v", o, err)
	}
}

// The email provider is down for one send: the row's attempts go to 1 with the error,
// and the next relay pass sends it.
func TestEmailProviderDown(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	const jobID = "00000000-0000-4000-8000-000000000503"
	p.process(p.enqueue(jobID, "Email later."))
	p.sink.FailNext(1)
	relay := p.relay(outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	if r := p.pass(relay); r.Retrying != 1 || r.Sent != 0 {
		t.Fatalf("pass with the provider down: %+v, want one retrying", r)
	}
	var attempts int
	var lastError *string
	var sent *time.Time
	if err := p.pool.QueryRow(context.Background(), `SELECT attempts, last_error, sent_at FROM outbox WHERE dedupe_key = $1`,
		summaries.DedupeKey(jobID)).Scan(&attempts, &lastError, &sent); err != nil {
		t.Fatal(err)
	}
	if attempts != 1 || lastError == nil || !strings.Contains(*lastError, "503") || sent != nil {
		t.Fatalf("row after the failed send: attempts %d, last_error %v, sent %v", attempts, lastError, sent)
	}
	p.effects(jobID, 1, 1, 0)
	time.Sleep(20 * time.Millisecond) // the 1ms backoff
	if r := p.pass(relay); r.Sent != 1 {
		t.Fatalf("next pass: %+v, want it sent", r)
	}
	if st := p.sink.Stats(); st.Failed != 1 {
		t.Fatalf("sink stats %+v, want one refused send", st)
	}
	p.effects(jobID, 1, 1, 1)
}

// The relay delivers and dies (kill -9) before marking the row sent: after the lease
// another relay sends it again, with the same dedupe key. The outbox does not make the
// provider call exactly-once; the key lets a provider that honours it apply it once.
func TestRelayDiesAfterSendBeforeMark(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	const jobID = "00000000-0000-4000-8000-0000000000a5"
	p.process(p.enqueue(jobID, "Sent twice, one key."))
	p.sink.SetLatency(time.Hour) // the delivery is recorded on arrival; the answer never comes
	const lease = 2 * time.Second
	first := testenv.Start(t, testenv.Binary(t), []string{"ONCEFLOW_DATABASE_URL=" + p.dsn, "ONCEFLOW_SENDER=webhook",
		"ONCEFLOW_WEBHOOK_URL=" + p.hook.URL, "ONCEFLOW_RELAY_LEASE=" + lease.String(), "ONCEFLOW_RELAY_INTERVAL=50ms"}, "relay")
	key := summaries.DedupeKey(jobID)
	testenv.WaitFor(t, 20*time.Second, "the first delivery", func() bool { return p.sink.Count(key) == 1 })
	first.Kill()
	p.sink.SetLatency(0)
	var claimedBy *string
	var claimedUntil, sent *time.Time
	if err := p.pool.QueryRow(context.Background(), `SELECT claimed_by, claimed_until, sent_at FROM outbox WHERE dedupe_key = $1`,
		key).Scan(&claimedBy, &claimedUntil, &sent); err != nil {
		t.Fatal(err)
	}
	if claimedBy == nil || claimedUntil == nil || sent != nil {
		t.Fatalf("after the kill: claimed_by %v, sent_at %v; want claimed and unsent", claimedBy, sent)
	}

	relay := p.relay(outbox.Config{})
	testenv.WaitFor(t, 20*time.Second, "the second relay to send the row after the lease", func() bool { return p.pass(relay).Sent == 1 })
	ds := p.sink.Deliveries()
	if len(ds) != 2 || ds[0].Key != key || ds[1].Key != key {
		t.Fatalf("deliveries %+v, want two with the key %s", ds, key)
	}
	if ds[1].At.Before(claimedUntil.Add(-50 * time.Millisecond)) {
		t.Fatalf("sent again at %v, before the dead relay's lease ended at %v", ds[1].At, *claimedUntil)
	}
	if n := count(t, p.pool, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL AND attempts = 0`); n != 1 {
		t.Fatalf("%d rows sent without a failed attempt, want 1", n)
	}
	p.effects(jobID, 1, 1, 2)
}
