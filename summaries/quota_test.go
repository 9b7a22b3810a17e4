package summaries_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// quotaModel is llm/fakeserver behind a switch: while exhausted is set, every chat
// completion gets OpenAI's 429 insufficient_quota answer, as a real account over its
// spend limit does, and is counted.
type quotaModel struct {
	fake      *fakeserver.Server
	exhausted atomic.Bool
	refused   atomic.Int64 // quota answers given
	served    atomic.Int64 // requests passed to the fake
}

func (q *quotaModel) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/chat/completions" && q.exhausted.Load() {
		q.refused.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}`)
		return
	}
	q.served.Add(1)
	q.fake.ServeHTTP(w, r)
}

// An exhausted quota is the provider's state, not the jobs': with MaxDeliveries 2 and a
// short ClaimIdle, a backlog meeting a quota stop for many ClaimIdle periods is never
// dead-lettered, the provider sees one call and then only the breaker's probes (not one
// call per job per delivery), and once the quota is back every job runs once: one
// summary and one email each.
func TestQuotaStopSpendsNoBacklog(t *testing.T) {
	t.Parallel()
	p := newPipeline(t)
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	model := &quotaModel{fake: fs}
	model.exhausted.Store(true)
	srv := httptest.NewServer(model)
	t.Cleanup(srv.Close)
	client := openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "test-key"})

	const probe = 300 * time.Millisecond
	b, err := breaker.New(breaker.Config{Name: "llm", ProbeInterval: probe, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	const jobs = 12
	ids := make([]string, jobs)
	for i := range ids {
		ids[i] = fmt.Sprintf("00000000-0000-4000-8000-%012d", 4290+i)
		p.enqueue(ids[i], fmt.Sprintf("Quota job number %d.", i))
	}
	h := newHandler(t, p.pool, client, handlerConfig{Retry: fastRetries, Breaker: b})
	rec := &recorder{h: h}
	const claimIdle = 200 * time.Millisecond
	startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: rec, Gate: b,
		ClaimIdle: claimIdle, MaxDeliveries: 2, Concurrency: 4})

	// Many times MaxDeliveries × ClaimIdle, several probes.
	testenv.WaitFor(t, 20*time.Second, "the breaker to open", func() bool { return b.Err() != nil })
	time.Sleep(12 * claimIdle)
	if d := deadLetters(t, p); d != 0 {
		t.Fatalf("%d dead letters during the quota stop, want none", d)
	}
	refused := model.refused.Load()
	// One call found the stop, then one probe per interval (and at most a few calls that
	// raced the first answer); never one call per job and delivery.
	if limit := int64(4 + int(12*claimIdle/probe)*2); refused < 1 || refused > limit {
		t.Fatalf("the provider refused %d calls during the stop, want between 1 and %d", refused, limit)
	}
	if n := count(t, p.pool, `SELECT count(*) FROM summaries`); n != 0 {
		t.Fatalf("%d summaries while the quota is exhausted", n)
	}

	model.exhausted.Store(false) // the account is topped up
	testenv.WaitFor(t, 30*time.Second, "every job summarised", func() bool {
		return count(t, p.pool, `SELECT count(*) FROM summaries`) == jobs
	})
	if b.Err() != nil {
		t.Fatalf("breaker still open after the quota came back: %v", b.Err())
	}
	relay := p.relay(outbox.Config{})
	for range 3 {
		p.pass(relay)
	}
	for _, id := range ids {
		if s := count(t, p.pool, `SELECT count(*) FROM summaries WHERE job_id = $1`, id); s != 1 {
			t.Fatalf("job %s: %d summaries, want 1", id, s)
		}
		if e := p.sink.Count(summaries.DedupeKey(id)); e != 1 {
			t.Fatalf("job %s: %d emails, want 1", id, e)
		}
	}
	if d := deadLetters(t, p); d != 0 {
		t.Fatalf("%d dead letters, want none", d)
	}
	if got := fs.Stats().ByStatus["200"]; got != jobs {
		t.Fatalf("the model answered %d calls, want one per job (%d)", got, jobs)
	}
	// Every run, during the stop and after, was the entry's first counted delivery.
	for _, r := range rec.Runs() {
		if r.deliveries != 1 {
			t.Fatalf("a run with delivery count %d: the stop spent deliveries", r.deliveries)
		}
	}
}

// deadLetters counts the dead-letter stream.
func deadLetters(t *testing.T, p *pipeline) int64 {
	t.Helper()
	n, err := p.rdb.XLen(context.Background(), p.keys.Dead()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}
