package onceflow_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/queue"
)

// The model's limiter inside a Client, against real Redis and PostgreSQL and fake-llm
// over HTTP.

// A tenant over its daily token budget: its job stays queued, without spending an
// attempt, and JobState says why and until when; another tenant's job runs.
func TestJobOverBudgetStaysQueuedWithItsReason(t *testing.T) {
	t.Parallel()
	// The budget is exactly what one call reserves (its estimate: the prompt and 1024
	// output tokens): the first call fits, and once it has used any token the second
	// does not, until the next UTC day. The texts are as long as each other.
	budget := int64(llm.EstimateTokens(prompt("The first ticket.")))
	e := newModelEnv(t, fakeserver.Config{}, onceflow.Config{Limits: limiter.Config{TenantTokenBudget: budget}},
		func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
			_, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
			return err
		})
	ctx := context.Background()
	enqueue := func(tenant, text string) string {
		t.Helper()
		res, err := e.client.Enqueue(ctx, supportArgs{Text: text}, &onceflow.EnqueueOpts{Tenant: tenant})
		if err != nil {
			t.Fatal(err)
		}
		return res.JobID
	}
	first := enqueue("acme", "The first ticket.")
	e.start()
	testenv.WaitFor(t, 20*time.Second, "the first job", func() bool {
		st, err := e.client.JobState(ctx, "acme", first)
		return err == nil && st.Status == onceflow.StatusDone
	})
	second := enqueue("acme", "A second ticket!.")
	other := enqueue("globex", "Their own ticket.")
	var st *onceflow.JobState
	testenv.WaitFor(t, 20*time.Second, "the second job to wait for the budget", func() bool {
		var err error
		st, err = e.client.JobState(ctx, "acme", second)
		return err == nil && st.Waiting != ""
	})
	tomorrow := time.Now().UTC().Truncate(24 * time.Hour).Add(24 * time.Hour)
	if st.Status != onceflow.StatusQueued || !strings.Contains(st.Waiting, "token budget of tenant acme") ||
		st.RunAt.Before(tomorrow) || st.RunAt.After(tomorrow.Add(2*time.Minute)) {
		t.Fatalf("over budget: %+v, want queued, the budget named, running at the next UTC day (%v)", st, tomorrow)
	}
	testenv.WaitFor(t, 20*time.Second, "the other tenant's job", func() bool {
		st, err := e.client.JobState(ctx, "globex", other)
		return err == nil && st.Status == onceflow.StatusDone
	})
	if n := e.calls(); n != 2 {
		t.Fatalf("%d model calls, want 2 (acme's first, globex's)", n)
	}
	if d := e.deadLetters(); len(d) != 0 {
		t.Fatalf("dead letters: %+v", d)
	}
}

// A 429 spends no attempt: the limiter pauses the model until its Retry-After and the
// job waits in the scheduled set, then runs; with MaxDeliveries 1 a spent attempt
// would have dead-lettered it. The same on a queue of 3 partitions: the limiter is the
// model's, whatever partition the job is in, and its wait lands in the job's partition.
func TestRateLimitedCallSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	for _, parts := range []int{1, 3} {
		t.Run(fmt.Sprintf("partitions=%d", parts), func(t *testing.T) {
			t.Parallel()
			testRateLimitedCallSpendsNoAttempt(t, parts)
		})
	}
}

func testRateLimitedCallSpendsNoAttempt(t *testing.T, parts int) {
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var requests, limited atomic.Int64
	srv := limitedProvider(t, fs, func() bool {
		if requests.Add(1) == 1 {
			limited.Add(1)
			return true
		}
		return false
	})
	e := newModelEnv(t, fakeserver.Config{}, onceflow.Config{
		Model:  openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"}),
		Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {ClaimIdle: time.Minute, MaxDeliveries: 1, Partitions: parts}},
	}, func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
		_, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
		return err
	})
	ctx := context.Background()
	// A job id in a partition other than 0 when there are several.
	opts := &onceflow.EnqueueOpts{}
	for i := 0; parts > 1 && queue.PartitionOf(opts.JobID, parts) == 0; i++ {
		opts.JobID = fmt.Sprintf("limited-%d", i)
	}
	res, err := e.client.Enqueue(ctx, supportArgs{Text: "Rate limited first."}, opts)
	if err != nil {
		t.Fatal(err)
	}
	id := res.JobID
	e.start()
	testenv.WaitFor(t, 20*time.Second, "the job", func() bool {
		st, err := e.client.JobState(ctx, "", id)
		return err == nil && st.Status == onceflow.StatusDone
	})
	runs := e.runs.all()
	if len(runs) != 2 || runs[0].delivery != 1 || runs[1].delivery != 1 {
		t.Fatalf("runs %+v: want two runs of attempt 1 (the 429 spent none)", runs)
	}
	if runs[1].at.Sub(runs[0].at) < 900*time.Millisecond {
		t.Fatalf("the second run came %v after the 429, before its Retry-After of 1s", runs[1].at.Sub(runs[0].at))
	}
	if requests.Load() != 2 || limited.Load() != 1 {
		t.Fatalf("%d requests, %d limited: want one 429 and one answer (retry.Do must not retry a paused model in-process)", requests.Load(), limited.Load())
	}
}

// After a pause the jobs that waited for it do not all go at once into a limit that
// may not have come back: one probe goes (one a second while none answers), and the
// others follow its answer. Here the provider answers 429 with Retry-After: 1 (no
// rate-limit headers, as many gateways do) for 5 seconds to 40 jobs: about one request
// a second reaches it, not one per waiting job; then every job completes, one answer
// each.
func TestPauseEndsWithOneProbeNotAHerd(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var limitedOn atomic.Bool
	var requests, tooMany atomic.Int64
	limitedOn.Store(true)
	srv := limitedProvider(t, fs, func() bool {
		requests.Add(1)
		if limitedOn.Load() {
			tooMany.Add(1)
			return true
		}
		return false
	})
	e := newModelEnv(t, fakeserver.Config{}, onceflow.Config{
		Model: openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"}),
	}, func(ctx context.Context, j *onceflow.Job[supportArgs]) error {
		_, err := j.Complete(ctx, "summarise", prompt(j.Args.Text))
		return err
	})
	ids := make([]string, 40)
	for i := range ids {
		ids[i] = e.enqueue(fmt.Sprintf("Ticket %d: the parcel never came.", i))
	}
	e.start()
	// The first contact: every worker slot may call before the first 429 is back.
	testenv.WaitFor(t, 10*time.Second, "the first 429", func() bool { return tooMany.Load() > 0 })
	time.Sleep(500 * time.Millisecond)
	before := requests.Load()
	time.Sleep(5 * time.Second)
	during := requests.Load() - before
	limitedOn.Store(false)
	// One probe a pause: a 1s pause, then a probe that meets the 429 again, about 5
	// in 5 seconds; a herd is one request per waiting job each second (85 before).
	if during > 12 {
		t.Fatalf("%d requests reached the provider in 5s of 429s with Retry-After 1, want about one a second (a probe per pause)", during)
	}
	ctx := context.Background()
	testenv.WaitFor(t, 30*time.Second, "every job done", func() bool {
		for _, id := range ids {
			st, err := e.client.JobState(ctx, "", id)
			if err != nil || st.Status != onceflow.StatusDone {
				return false
			}
		}
		return true
	})
	if got := fs.Stats().Requests; got != int64(len(ids)) {
		t.Fatalf("the provider answered %d calls for %d jobs, want one each", got, len(ids))
	}
	if dl := e.deadLetters(); len(dl) != 0 {
		t.Fatalf("%d dead letters, want none (waiting spends no attempt)", len(dl))
	}
	t.Logf("%d requests in 5s of 429s; %d requests in all for %d jobs", during, requests.Load(), len(ids))
}

// limitedProvider serves fake-llm fs, but answers 429 with Retry-After: 1 (and no
// rate-limit headers, as many gateways do) to each request for which limited says so.
func limitedProvider(t *testing.T, fs *fakeserver.Server, limited func() bool) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if limited() {
			w.Header().Set("Retry-After", "1")
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = w.Write([]byte(`{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}`))
			return
		}
		fs.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { fs.Close(); srv.Close() })
	return srv
}
