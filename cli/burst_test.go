package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// Two `onceflow serve` processes take a burst of POSTs from clients that retry with the
// same key and body on any connection error or 5xx (switching server), sometimes send a
// request twice at once, and sometimes send it again after a 202. Each server is killed
// with kill -9 in the middle of the burst and restarted. Then `onceflow work` and
// `onceflow relay` drain the queue against `onceflow fake-llm` and a webhook sink.
//
// Why nothing can be enqueued twice: on this route the whole accept is one Lua script
// (redisstore.Store.Accept), and Redis runs a script to the end or not at all. It checks
// the key and fingerprint, XADDs the job, writes the job index and stores the 202 in one
// step, so there is no moment at which the job is enqueued but the response not yet
// stored (the window the seed's SET NX, XADD, finalise sequence has, which its UUIDv5 job
// id only papers over downstream). A kill -9 of the API therefore lands either before
// the script reached Redis (nothing was written: the retry is accepted as new) or after
// it ran (everything was written: the retry replays the stored 202 with the same job id,
// only the first answer was lost). The test shows it: the stream holds exactly one entry
// per key, whatever the kills interrupted, and every answer a key got names one job id.
func TestServeKilledMidBurst(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	pool, dsn := testenv.Postgres(t)
	bin := testenv.Binary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_SHUTDOWN_TIMEOUT=5s"}

	ports := [2]int{testenv.FreePort(t), testenv.FreePort(t)}
	var servers [2]atomic.Pointer[testenv.Process] // the current serve process on each port
	startServe := func(i int) {
		p := testenv.Start(t, bin, append(env, fmt.Sprintf("ONCEFLOW_HTTP_ADDR=127.0.0.1:%d", ports[i])), "serve")
		p.WaitLog(ctx, "http listening")
		servers[i].Store(p)
	}
	startServe(0)
	startServe(1)

	// The burst: at least minJobs jobs, from two tenants that share key strings (the same
	// key from two tenants is two jobs), sent by 24 clients pacing themselves. The burst
	// goes on until both kills are done, so both land inside it.
	const minJobs, maxJobs = 240, 3000
	type job struct{ tenant, apiKey, key, body string }
	jobs := make([]job, maxJobs)
	for i := range jobs {
		tenant, apiKey := "acme", testKeyAcme
		if i%2 == 1 {
			tenant, apiKey = "globex", testKeyGlobex
		}
		jobs[i] = job{tenant, apiKey, fmt.Sprintf("burst-key-%06d", i/2), summaryBody(fmt.Sprintf("Burst job %d: figures for the account team.", i))}
	}
	type answer struct {
		jobID    string
		replayed bool
		via      *testenv.Process // the serve process that answered
	}
	answers := make([][]answer, maxJobs)
	var mu sync.Mutex
	var done, connErrors, serverErrors atomic.Int64
	client := &http.Client{Timeout: 10 * time.Second}
	// inflight counts the requests of job i waiting for server 0 or 1; a request stops
	// counting only after its answer is recorded.
	inflight := make([][2]atomic.Int32, maxJobs)
	// attempt sends job i once to server srv and reports whether it got an answer below 500.
	attempt := func(i, srv int) bool {
		inflight[i][srv].Add(1)
		defer inflight[i][srv].Add(-1)
		via := servers[srv].Load()
		base := fmt.Sprintf("http://127.0.0.1:%d", ports[srv])
		r, err := postSummary(ctx, client, base, jobs[i].apiKey, jobs[i].key, jobs[i].body)
		switch {
		case err != nil:
			connErrors.Add(1)
			return false
		case r.code >= 500:
			serverErrors.Add(1)
			return false
		case r.code != http.StatusAccepted:
			t.Errorf("job %d: %d %s", i, r.code, r.body)
			return true
		}
		var a struct {
			JobID  string `json:"job_id"`
			Status string `json:"status"`
		}
		if err := json.Unmarshal(r.body, &a); err != nil || a.Status != "queued" {
			t.Errorf("job %d: body %s", i, r.body)
			return true
		}
		mu.Lock()
		answers[i] = append(answers[i], answer{a.JobID, r.header.Get(idempotency.HeaderReplayed) == "true", via})
		mu.Unlock()
		return true
	}
	// submit sends job i until it gets an answer below 500, switching server per attempt.
	submit := func(i, first int) {
		for try := first; ctx.Err() == nil && !attempt(i, try%2); try++ {
			time.Sleep(20 * time.Millisecond)
		}
	}
	next := make(chan int)
	var clients sync.WaitGroup
	for c := 0; c < 24; c++ {
		clients.Add(1)
		go func() {
			defer clients.Done()
			for i := range next {
				switch {
				case i%7 == 0: // two at once, to different servers
					var both sync.WaitGroup
					both.Add(2)
					go func() { defer both.Done(); submit(i, 0) }()
					go func() { defer both.Done(); submit(i, 1) }()
					both.Wait()
				case i%5 == 0: // answered, and sent again anyway
					submit(i, i)
					submit(i, i+1)
				default:
					submit(i, i)
				}
				done.Add(1)
				time.Sleep(50 * time.Millisecond)
			}
		}()
	}
	// The first server is killed outright, wherever its requests are. The second is
	// killed at the worst moment for a crash: frozen (SIGSTOP, as a long GC pause or a
	// stalled VM would), it is killed only once Redis shows that it accepted a job whose
	// client has no answer yet (the script ran; the answer dies with the process), and
	// thawed to try again a moment later otherwise. Those clients' retries must replay
	// the same job.
	var killedAt []int64
	lostAnswers := map[int]bool{} // jobs accepted by the frozen server before it could answer
	var frozen *testenv.Process
	var killer sync.WaitGroup
	var killed atomic.Bool
	killer.Add(1)
	go func() {
		defer killer.Done()
		defer killed.Store(true)
		for done.Load() < minJobs/4 && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
		servers[0].Load().Kill()
		killedAt = append(killedAt, done.Load())
		time.Sleep(200 * time.Millisecond)
		startServe(0)
		for done.Load() < minJobs/2 && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
		p := servers[1].Load()
		frozen = p
		acceptedNow := func() map[string]bool {
			accepted := map[string]bool{}
			for _, m := range streamMessages(t, rdb, keys) {
				accepted[m.JobID] = true
			}
			return accepted
		}
		for try := 0; try < 150 && len(lostAnswers) == 0; try++ {
			before := acceptedNow()
			p.Signal(syscall.SIGSTOP)
			time.Sleep(20 * time.Millisecond) // Redis finishes what it was sent; clients record what they got
			after := acceptedNow()
			mu.Lock()
			for i := range jobs {
				// Accepted since the snapshot, by a request to the frozen server (the job's
				// only request in flight), and not answered.
				id := jobIDOfBurst(jobs[i].tenant, jobs[i].key)
				if after[id] && !before[id] && inflight[i][1].Load() > 0 && inflight[i][0].Load() == 0 && len(answers[i]) == 0 {
					lostAnswers[i] = true
				}
			}
			mu.Unlock()
			if len(lostAnswers) > 0 {
				// An answer the server sent just before it stopped may still be on its
				// way to the client: such a job was not caught between its accept and
				// its answer. Give it time to arrive, and try again if it does.
				time.Sleep(100 * time.Millisecond)
				mu.Lock()
				for i := range lostAnswers {
					if len(answers[i]) > 0 {
						delete(lostAnswers, i)
					}
				}
				mu.Unlock()
			}
			if len(lostAnswers) == 0 {
				p.Signal(syscall.SIGCONT)
				time.Sleep(15 * time.Millisecond)
			}
		}
		p.Kill()
		killedAt = append(killedAt, done.Load())
		time.Sleep(200 * time.Millisecond)
		startServe(1)
	}()
	n := 0
	for ; n < maxJobs && (n < minJobs || !killed.Load()); n++ {
		next <- n
	}
	close(next)
	clients.Wait()
	killer.Wait()
	jobs, answers = jobs[:n], answers[:n]
	if t.Failed() {
		t.FailNow()
	}
	for _, at := range killedAt {
		if at >= int64(n) {
			t.Fatalf("a kill came after the burst (%d of %d jobs answered): nothing tested", at, n)
		}
	}
	if connErrors.Load() == 0 {
		t.Fatal("no client saw a connection error: the kills did not interrupt the burst")
	}
	t.Logf("kills after %v jobs; %d connection errors and %d 5xx retried; %d jobs accepted by the frozen server without an answer",
		killedAt, connErrors.Load(), serverErrors.Load(), len(lostAnswers))
	// A job counted lost whose answer the frozen server had sent before it stopped (the
	// client had not recorded it yet) was not lost: its answer came.
	for i := range lostAnswers {
		for _, a := range answers[i] {
			if a.via == frozen {
				delete(lostAnswers, i)
			}
		}
	}
	if len(lostAnswers) == 0 {
		t.Fatal("never caught the frozen server between accepting a job and answering: the worst case was not tested")
	}

	// Every answer of a key names its one job id, the UUIDv5 of the scope; a key is
	// accepted as new at most once; the stream holds one entry per key.
	want := map[string]bool{}
	for i, as := range answers {
		id := jobIDOfBurst(jobs[i].tenant, jobs[i].key)
		want[id] = true
		fresh := 0
		for _, a := range as {
			if a.jobID != id {
				t.Fatalf("job %d got job id %s, want %s (all answers: %+v)", i, a.jobID, id, as)
			}
			if !a.replayed {
				fresh++
			}
		}
		if len(as) == 0 || fresh > 1 {
			t.Fatalf("job %d: answers %+v, want at least one and at most one not replayed", i, as)
		}
		if lostAnswers[i] && fresh != 0 {
			t.Fatalf("job %d was accepted by the killed server before it answered, yet a retry was accepted as new: %+v", i, as)
		}
		if (i%7 == 0 || i%5 == 0) && len(as) != 2 {
			t.Fatalf("job %d: %d answers, want 2", i, len(as))
		}
	}
	if len(want) != n {
		t.Fatalf("%d distinct job ids for %d jobs", len(want), n)
	}
	entries := streamMessages(t, rdb, keys)
	enqueued := map[string]int{}
	for _, m := range entries {
		enqueued[m.JobID]++
	}
	if len(entries) != n || len(enqueued) != n {
		t.Fatalf("%d stream entries for %d distinct jobs, want exactly one per job (%d)", len(entries), len(enqueued), n)
	}

	// Drain: fake-llm, a worker and a relay, as processes.
	llmProc := testenv.Start(t, bin, nil, "fake-llm", "--addr", "127.0.0.1:0")
	llmBase := fmt.Sprint(llmProc.WaitLog(ctx, "fake-llm listening")["base_url"])
	sink := webhooksink.New(webhooksink.Options{})
	hook := httptest.NewServer(sink)
	t.Cleanup(hook.Close)
	work := testenv.Start(t, bin, append(env, "ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL="+llmBase, "OPENAI_API_KEY=test-key"), "work")
	relay := testenv.Start(t, bin, append(env, "ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL="+hook.URL, "ONCEFLOW_RELAY_INTERVAL=50ms"), "relay")
	testenv.WaitFor(t, 60*time.Second, "every job's email", func() bool {
		var sent int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL`).Scan(&sent)
		return sink.Stats().DistinctKeys == n && sent == n
	})
	for _, p := range []*testenv.Process{work, relay} {
		p.Signal(syscall.SIGTERM)
		if code := p.Wait(20 * time.Second); code != 0 {
			t.Fatalf("exit %d after SIGTERM", code)
		}
	}

	rows, err := pool.Query(ctx, `SELECT job_id::text FROM summaries`)
	if err != nil {
		t.Fatal(err)
	}
	summarised := 0
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		if !want[id] {
			t.Fatalf("summary of an unknown job %s", id)
		}
		summarised++
	}
	if rows.Err() != nil || summarised != n {
		t.Fatalf("%d summaries (%v), want %d: one per accepted job", summarised, rows.Err(), n)
	}
	st := sink.Stats()
	if st.Deliveries != n || len(st.Duplicates) != 0 || st.MissingKey != 0 {
		t.Fatalf("sink %+v, want exactly one delivery per job", st)
	}
	for id := range want {
		if sink.Count(summaries.DedupeKey(id)) != 1 {
			t.Fatalf("job %s: %d emails, want 1", id, sink.Count(summaries.DedupeKey(id)))
		}
	}
	llmStats, err := fakeserver.FetchStats(ctx, nil, llmBase)
	if err != nil || llmStats.Requests != int64(n) {
		t.Fatalf("fake-llm stats %+v (%v), want one model call per job", llmStats, err)
	}

	audit := testenv.Start(t, bin, env, "audit", "--json")
	code := audit.Wait(20 * time.Second)
	var report auditReport
	if err := json.Unmarshal([]byte(audit.Stdout()), &report); err != nil {
		t.Fatalf("audit --json: %v\n%s", err, audit.Stdout())
	}
	if code != 0 || len(report.Violations) != 0 || report.Summaries == nil || *report.Summaries != int64(n) ||
		*report.OutboxSent != int64(n) || *report.DLQ != 0 || *report.StreamPending != 0 {
		t.Fatalf("audit: exit %d, %s %q", code, report.counts(), report.Violations)
	}
}

// jobIDOfBurst is the job id the API derives for tenant's key.
func jobIDOfBurst(tenant, key string) string {
	return summaries.JobID(idempotency.Scope{Tenant: tenant, Method: http.MethodPost, Path: "/v1/summaries", Key: key})
}

// streamMessages returns the messages in the queue's stream, oldest first.
func streamMessages(t *testing.T, rdb *redis.Client, keys queue.Keys) []queue.Message {
	t.Helper()
	entries, err := rdb.XRange(context.Background(), keys.Stream(), "-", "+").Result()
	if err != nil {
		t.Error(err)
		return nil
	}
	out := make([]queue.Message, 0, len(entries))
	for _, e := range entries {
		m, err := queue.ParseMessage(e.Values)
		if err != nil {
			t.Errorf("stream entry %s: %v", e.ID, err)
			continue
		}
		out = append(out, m)
	}
	return out
}
