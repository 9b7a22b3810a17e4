package summaries_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// Issue 12, item 7: a client re-sends a key after its stored response expired, for a job
// that was dead-lettered. The client asked for the work again, so it runs again, like
// `onceflow dlq replay`: the accept retires the dead letter, the index says queued (and
// does not expire while the job waits), exactly one new stream entry is added, and when
// the rerun succeeds the job is done and audit finds no job both summarised and
// dead-lettered.
func TestResendAfterStoredResponseExpiredRerunsDeadLetteredJob(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	pool, _ := testenv.Postgres(t)
	base := newAPIServer(t, rdb, prefix, pool).URL
	ctx := context.Background()
	const key = "resend-after-expiry-0001"
	body := validBody("Incident review: the pager fired twice.")
	jobID := jobIDOf("acme", key)
	state := func() (int, map[string]any) {
		t.Helper()
		r := get(t, base, keyAcme, jobID)
		if r.code != http.StatusOK {
			return r.code, nil
		}
		return r.code, r.json(t)
	}

	if r := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body}); r.code != http.StatusAccepted {
		t.Fatalf("first POST: %d %s", r.code, r.body)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID)).Val(); ttl != -1 {
		t.Errorf("job index TTL %v while queued, want none (a job waiting longer than the TTL must not become 404)", ttl)
	}

	// The model refuses the first run (a 400 is permanent): the job is dead-lettered.
	client := fake.New()
	client.FailNext(&llm.APIError{Provider: "openai", StatusCode: 400, Type: "invalid_request_error", Code: "context_length_exceeded", Message: "too long"})
	h := newHandler(t, pool, client, handlerConfig{})
	const jobTTL = 300 * time.Millisecond // the workers' index TTL (ONCEFLOW_RESULT_TTL)
	stop := startWorker(t, queue.WorkerConfig{Redis: rdb, Keys: keys, Handler: h, Concurrency: 1, JobTTL: jobTTL})
	testenv.WaitFor(t, 20*time.Second, "the dead letter", func() bool {
		_, m := state()
		return m["status"] == "failed"
	})
	stop()
	dead, err := queue.FindDead(ctx, rdb, keys, jobID)
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead letters %+v (%v), want one", dead, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID)).Val(); ttl != -1 {
		t.Errorf("job index TTL %v while dead-lettered, want none", ttl)
	}
	time.Sleep(2 * jobTTL)
	if code, m := state(); code != http.StatusOK || m["status"] != "failed" {
		t.Errorf("GET of the dead-lettered job after twice the index TTL: %d %v, want failed", code, m)
	}

	// The stored response expires (ONCEFLOW_RESULT_TTL): delete the record.
	store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	recordKey, err := store.AcceptKey(keys.Stream(), idempotency.Scope{Tenant: "acme", Method: http.MethodPost, Path: "/v1/summaries", Key: key})
	if err != nil {
		t.Fatal(err)
	}
	if n := rdb.Del(ctx, recordKey).Val(); n != 1 {
		t.Fatalf("deleted %d idempotency records at %s, want 1", n, recordKey)
	}
	entriesBefore := rdb.XLen(ctx, keys.Stream()).Val()

	// The same key again: a new 202, the job queued again, its dead letter retired.
	r := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body})
	if r.code != http.StatusAccepted || r.header.Get(idempotency.HeaderReplayed) != "" || r.json(t)["job_id"] != jobID {
		t.Fatalf("re-sent POST: %d replayed %q %s, want a new 202 for job %s", r.code, r.header.Get(idempotency.HeaderReplayed), r.body, jobID)
	}
	if n := rdb.XLen(ctx, keys.Stream()).Val() - entriesBefore; n != 1 {
		t.Errorf("the re-sent POST added %d stream entries, want exactly 1", n)
	}
	if code, m := state(); code != http.StatusOK || m["status"] != "queued" || m["error"] != nil {
		t.Errorf("GET after the re-sent POST: %d %v, want queued", code, m)
	}
	tenant, st, reason, err := queue.JobState(ctx, rdb, keys, jobID)
	if err != nil || tenant != "acme" || st != queue.StateQueued || reason != "" {
		t.Errorf("job index after the re-sent POST: %q %q %q %v, want acme queued", tenant, st, reason, err)
	}
	if f := rdb.HMGet(ctx, keys.Job(jobID), "dead_id", "failed_at").Val(); f[0] != nil || f[1] != nil {
		t.Errorf("job index still records the failure: dead_id %v failed_at %v", f[0], f[1])
	}
	if dead, err := queue.FindDead(ctx, rdb, keys, jobID); err != nil || len(dead) != 0 {
		t.Errorf("dead letters after the re-sent POST: %+v (%v), want none: the job runs again", dead, err)
	}
	if ttl := rdb.PTTL(ctx, keys.Job(jobID)).Val(); ttl != -1 {
		t.Errorf("job index TTL %v while queued again, want none", ttl)
	}
	time.Sleep(2 * jobTTL)
	if code, m := state(); code != http.StatusOK || m["status"] != "queued" {
		t.Errorf("GET of the queued job after twice the index TTL: %d %v, want queued", code, m)
	}

	// The rerun succeeds: done, and the pipeline's invariants hold; the index gets its
	// TTL once the job left the stream.
	startWorker(t, queue.WorkerConfig{Redis: rdb, Keys: keys, Handler: h, Concurrency: 1, JobTTL: jobTTL})
	testenv.WaitFor(t, 20*time.Second, "the rerun", func() bool {
		_, m := state()
		return m["status"] == "done"
	})
	if ttl := rdb.PTTL(ctx, keys.Job(jobID)).Val(); ttl != -1 {
		t.Errorf("job index TTL %v while its entry is still in the stream, want none", ttl)
	}
	// The trim (a worker runs it every TrimInterval) removes the acknowledged entry and
	// gives the index its TTL. Until the worker's batched XACK lands, the rerun's entry is
	// still pending and a trim removes only the dead-lettered run's: trim until the
	// stream is empty.
	testenv.WaitFor(t, 10*time.Second, "the trim to remove the acknowledged entries", func() bool {
		_, err := queue.Trim(ctx, rdb, keys, jobTTL)
		return err == nil && rdb.XLen(ctx, keys.Stream()).Val() == 0
	})
	testenv.WaitFor(t, 10*time.Second, "the job index to expire after the trim", func() bool {
		return rdb.Exists(ctx, keys.Job(jobID)).Val() == 0
	})
	if code, m := state(); code != http.StatusOK || m["status"] != "done" {
		t.Errorf("GET after the index expired: %d %v, want done (from the summary)", code, m)
	}
	rep, err := summaries.Audit(ctx, summaries.AuditConfig{DB: pool, Redis: rdb, Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Violations) != 0 || rep.DLQ != 0 || rep.Summaries != 1 {
		t.Errorf("audit after the rerun: violations %v, dlq %d, summaries %d; want none, 0, 1", rep.Violations, rep.DLQ, rep.Summaries)
	}
	if n := client.Calls(); n != 2 {
		t.Errorf("%d model calls, want 2 (the refused run and the rerun)", n)
	}
}
