package summaries_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/h2fault"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

// The workflow end to end against real Redis and PostgreSQL: the API's status table,
// the crash tests of docs/RELIABILITY.md (where a process dies it is a real `onceflow
// work` or `onceflow relay` killed with SIGKILL), HTTP/2 failures at the model
// provider's edge (the real OpenAI adapter over TLS, internal/testenv/h2fault), the
// llm_calls ledger, quota stops, resends and upgrades; each test counts the effects
// (model calls, summaries, outbox rows, emails delivered to a webhook sink).

// The job id namespace is what the docs say it is, and job ids are version 5 UUIDs of
// the scope under it.
func TestJobIDIsUUIDv5OfTheScope(t *testing.T) {
	t.Parallel()
	if want := uuid.NewSHA1(uuid.NameSpaceURL, []byte("https://github.com/onceflow/onceflow/jobs")); summaries.JobNamespace != want {
		t.Fatalf("JobNamespace %s, want %s (the documented derivation)", summaries.JobNamespace, want)
	}
	scope := idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/summaries", Key: "order-0123456789abcdef"}
	id := uuid.MustParse(summaries.JobID(scope))
	if id.Version() != 5 || id.Variant() != uuid.RFC4122 {
		t.Fatalf("job id %s: version %d variant %v", id, id.Version(), id.Variant())
	}
	if want := uuid.NewSHA1(summaries.JobNamespace, scope.Encode()); id != want {
		t.Fatalf("job id %s, want %s", id, want)
	}
	other := scope
	other.Tenant = "globex"
	if summaries.JobID(other) == id.String() {
		t.Fatal("two tenants' scopes share a job id")
	}
	if !queue.ValidJobID(id.String()) {
		t.Fatalf("job id %s is not in the queue's canonical form", id)
	}
}

// The POST status table of docs/api.md, over real HTTP against the shared Redis,
// with the effects (stream entries, job index, stored records) checked after each row.
func TestPostStatusTable(t *testing.T) {
	t.Parallel()
	inspect, keys, rt, base := countedAPIServer(t)
	ctx := context.Background()

	entries := func(want int) []queue.Message {
		t.Helper()
		jobs := streamJobs(t, inspect, keys)
		if len(jobs) != want {
			t.Fatalf("stream has %d entries, want %d", len(jobs), want)
		}
		return jobs
	}
	// accepted checks a 202 for a new job and returns its job id.
	accepted := func(r reply, tenant, key string) string {
		t.Helper()
		if r.code != http.StatusAccepted || r.header.Get(idempotency.HeaderReplayed) != "" {
			t.Fatalf("status %d replayed %q body %s, want a new 202", r.code, r.header.Get(idempotency.HeaderReplayed), r.body)
		}
		m := r.json(t)
		id, _ := m["job_id"].(string)
		if want := jobIDOf(tenant, key); id != want || m["status"] != "queued" || len(m) != 2 {
			t.Fatalf("body %s, want job_id %s (UUIDv5 of the scope) and status queued", r.body, want)
		}
		if loc := r.header.Get("Location"); loc != "/v1/summaries/"+id {
			t.Fatalf("Location %q", loc)
		}
		if ct := r.header.Get("Content-Type"); ct != "application/json" {
			t.Fatalf("Content-Type %q", ct)
		}
		return id
	}
	detail := func(r reply, code int, contains ...string) {
		t.Helper()
		if r.code != code {
			t.Fatalf("status %d body %s, want %d", r.code, r.body, code)
		}
		d, _ := r.json(t)["detail"].(string)
		for _, c := range contains {
			if !strings.Contains(d, c) {
				t.Fatalf("status %d detail %q does not contain %q", code, d, c)
			}
		}
	}

	// New request: 202, one Redis round trip, one stream entry, the job index.
	const key = "order-7f3c2a91-0001"
	body := validBody("Quarterly numbers: revenue up, churn down.")
	rt.Reset()
	first := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body})
	jobID := accepted(first, "acme", key)
	if n := rt.Redis(); n != 1 {
		t.Errorf("accepting a job took %d Redis round trips, want 1", n)
	}
	job := entries(1)[0]
	if job.JobID != jobID || job.Tenant != "acme" || string(job.Payload) != body {
		t.Fatalf("enqueued %+v, want job %s of acme with the canonical body %s", job, jobID, body)
	}
	if owner := inspect.HGet(ctx, keys.Job(jobID), "tenant").Val(); owner != "acme" {
		t.Fatalf("job index tenant %q, want acme", owner)
	}
	if ttl := inspect.PTTL(ctx, keys.Job(jobID)).Val(); ttl != -1 {
		t.Fatalf("job index TTL %v, want none while the job is queued (the worker sets the result TTL when it is done)", ttl)
	}

	// The same key and body again: the stored answer, byte for byte, marked replayed.
	rt.Reset()
	again := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body})
	if again.code != http.StatusAccepted || again.header.Get(idempotency.HeaderReplayed) != "true" ||
		again.body != first.body || again.header.Get("Location") != first.header.Get("Location") {
		t.Fatalf("replay: %d %v %s, want the first answer %s with Idempotent-Replayed: true", again.code, again.header, again.body, first.body)
	}
	if n := rt.Redis(); n != 1 {
		t.Errorf("a replay took %d Redis round trips, want 1", n)
	}
	entries(1)

	// The RFC 8941 quoted form is the same key; whitespace and key order do not make a
	// different body.
	for name, r := range map[string]request{
		"quoted key":        {apiKey: keyAcme, idemKey: `"` + key + `"`, ctype: "application/json", body: body},
		"reordered body":    {apiKey: keyAcme, idemKey: key, ctype: "application/json; charset=utf-8", body: "{\n  \"notify\" : \"team@example.com\",\n\t\"text\": \"Quarterly numbers: revenue up, churn down.\"\n}\n"},
		"tenant header":     {apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body, header: map[string]string{"X-Tenant-Id": "globex", "Tenant": "globex"}},
		"lower-case scheme": {idemKey: key, ctype: "application/json", body: body, header: map[string]string{"Authorization": "bearer " + keyAcme}},
	} {
		got := post(t, base, r)
		if got.code != http.StatusAccepted || got.header.Get(idempotency.HeaderReplayed) != "true" || got.body != first.body {
			t.Fatalf("%s: %d %s replayed %q, want the replay of %s", name, got.code, got.body, got.header.Get(idempotency.HeaderReplayed), first.body)
		}
	}
	entries(1)

	// The same key with a different body: 422, nothing written.
	detail(post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: validBody("another text")}),
		http.StatusUnprocessableEntity, "different request")
	entries(1)

	// Rejected before the store: nothing enqueued, nothing stored against the key (the
	// same key with a valid body afterwards is a new job).
	long := strings.Repeat("x", summaries.MaxTextChars+1)
	rejected := []struct {
		name     string
		r        request
		code     int
		contains []string
	}{
		{"no key", request{apiKey: keyAcme, ctype: "application/json", body: body}, 400, []string{"Idempotency-Key"}},
		{"short key", request{apiKey: keyAcme, idemKey: "short", ctype: "application/json", body: body}, 400, []string{"16"}},
		{"long key", request{apiKey: keyAcme, idemKey: strings.Repeat("k", 129), ctype: "application/json", body: body}, 400, []string{"128"}},
		{"unterminated quoted key", request{apiKey: keyAcme, idemKey: `"unterminated-0123456789`, ctype: "application/json", body: body}, 400, nil},
		{"unknown field", request{apiKey: keyAcme, idemKey: "rejected-0000000001", ctype: "application/json", body: `{"text":"hi","notify":"a@example.com","cc":"b@example.com"}`}, 400, []string{"cc", "unknown field"}},
		{"bad type", request{apiKey: keyAcme, idemKey: "rejected-0000000002", ctype: "application/json", body: `{"text":42,"notify":"a@example.com"}`}, 400, []string{"text"}},
		{"empty text", request{apiKey: keyAcme, idemKey: "rejected-0000000003", ctype: "application/json", body: `{"text":"","notify":"a@example.com"}`}, 400, []string{"text"}},
		{"text too long", request{apiKey: keyAcme, idemKey: "rejected-0000000004", ctype: "application/json", body: validBody(long)}, 400, []string{"text", "100000"}},
		{"bad email", request{apiKey: keyAcme, idemKey: "rejected-0000000005", ctype: "application/json", body: `{"text":"hi","notify":"not-an-address"}`}, 400, []string{"notify"}},
		{"no notify", request{apiKey: keyAcme, idemKey: "rejected-0000000006", ctype: "application/json", body: `{"text":"hi"}`}, 400, []string{"notify"}},
		{"bad JSON", request{apiKey: keyAcme, idemKey: "rejected-0000000007", ctype: "application/json", body: `{"text":"hi",`}, 400, []string{"body"}},
		{"over 1 MiB", request{apiKey: keyAcme, idemKey: "rejected-0000000008", ctype: "application/json", body: `{"text":"` + strings.Repeat("y", summaries.MaxBodyBytes) + `","notify":"a@example.com"}`}, 413, []string{"1048576"}},
		{"text/plain", request{apiKey: keyAcme, idemKey: "rejected-0000000009", ctype: "text/plain", body: body}, 415, []string{"application/json"}},
		{"no content type", request{apiKey: keyAcme, idemKey: "rejected-0000000010", body: body}, 415, []string{"application/json"}},
		{"no API key", request{idemKey: "rejected-0000000011", ctype: "application/json", body: body}, 401, []string{"API key"}},
		{"unknown API key", request{apiKey: "nobody-0123456789abcdef", idemKey: "rejected-0000000012", ctype: "application/json", body: body}, 401, []string{"API key"}},
		{"tenant header without a key", request{idemKey: "rejected-0000000013", ctype: "application/json", body: body, header: map[string]string{"X-Tenant-Id": "acme"}}, 401, nil},
	}
	for _, tc := range rejected {
		rt.Reset()
		got := post(t, base, tc.r)
		if got.code != tc.code {
			t.Fatalf("%s: status %d body %s, want %d", tc.name, got.code, got.body, tc.code)
		}
		detail(got, tc.code, tc.contains...)
		if tc.code == 401 && got.header.Get("WWW-Authenticate") == "" {
			t.Errorf("%s: 401 without WWW-Authenticate", tc.name)
		}
		if n := rt.Redis(); n != 0 {
			t.Errorf("%s: %d Redis round trips for a rejected request, want 0", tc.name, n)
		}
	}
	entries(1)
	for _, tc := range rejected {
		if k := tc.r.idemKey; strings.HasPrefix(k, "rejected-") {
			// Accepted as new now: nothing was stored against the key when it was refused.
			accepted(post(t, base, request{apiKey: keyAcme, idemKey: k, ctype: "application/json", body: body}), "acme", k)
		}
	}
	entries(14)

	// Two tenants, one key: two independent jobs, each owned by its tenant.
	const shared = "shared-key-0123456789"
	a := accepted(post(t, base, request{apiKey: keyAcme, idemKey: shared, ctype: "application/json", body: body}), "acme", shared)
	g := accepted(post(t, base, request{apiKey: keyGlobex, idemKey: shared, ctype: "application/json", body: validBody("a different text")}), "globex", shared)
	if a == g {
		t.Fatal("two tenants' requests share a job id")
	}
	jobs := entries(16)
	if jobs[14].JobID != a || jobs[14].Tenant != "acme" || jobs[15].JobID != g || jobs[15].Tenant != "globex" {
		t.Fatalf("last two entries %+v %+v", jobs[14], jobs[15])
	}
	for id, tenant := range map[string]string{a: "acme", g: "globex"} {
		if owner := inspect.HGet(ctx, keys.Job(id), "tenant").Val(); owner != tenant {
			t.Fatalf("job %s index tenant %q, want %s", id, owner, tenant)
		}
	}
	// The tenant comes from the key, never from a header: acme's key with a globex header
	// replays acme's job above (checked with the replays), and globex's own job stays
	// invisible to acme.
	if r := get(t, base, keyAcme, g); r.code != http.StatusNotFound {
		t.Fatalf("acme reading globex's job: %d %s", r.code, r.body)
	}
}

// Strict JSON (docs/api.md): member names are case-sensitive and may appear once.
// Each loose body is a 400 naming the field, stores nothing and enqueues nothing, so the
// same key is a new job afterwards.
func TestPostRejectsCaseFoldedAndDuplicateNames(t *testing.T) {
	t.Parallel()
	inspect, keys, rt, base := countedAPIServer(t)

	for i, tc := range []struct {
		body     string
		contains []string
	}{
		{`{"TEXT":"x","notify":"a@example.com"}`, []string{"TEXT", "unknown field"}},
		{`{"text":"a","Text":"b","notify":"a@example.com"}`, []string{"Text", "unknown field"}},
		{`{"text":"a","Notify":"a@example.com"}`, []string{"Notify", "unknown field"}},
		{`{"text":"a","text":"b","notify":"a@example.com"}`, []string{"text", "duplicate field"}},
		{`{"text":"a","notify":"a@example.com","notify":"b@example.com"}`, []string{"notify", "duplicate field"}},
	} {
		key := fmt.Sprintf("strict-json-%010d", i)
		rt.Reset()
		r := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: tc.body})
		if r.code != http.StatusBadRequest {
			t.Fatalf("%s: status %d body %s, want 400", tc.body, r.code, r.body)
		}
		d, _ := r.json(t)["detail"].(string)
		for _, c := range tc.contains {
			if !strings.Contains(d, c) {
				t.Fatalf("%s: detail %q does not contain %q", tc.body, d, c)
			}
		}
		if n := rt.Redis(); n != 0 {
			t.Errorf("%s: %d Redis round trips for a rejected request, want 0", tc.body, n)
		}
		if a := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: validBody("x")}); a.code != http.StatusAccepted {
			t.Fatalf("%s: the key afterwards: status %d body %s, want a new 202", tc.body, a.code, a.body)
		}
	}
	if jobs := streamJobs(t, inspect, keys); len(jobs) != 5 {
		t.Fatalf("stream has %d entries, want 5 (the valid retries only)", len(jobs))
	}
}

// The worker decodes a queued payload as strictly as the API decodes a body: a payload
// with a case-folded or repeated name (enqueued by something other than the API) is
// dead-lettered before any model call, instead of being read as the field it resembles.
func TestHandlerRefusesALoosePayload(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	client := fake.New()
	h := newHandler(t, pool, client, handlerConfig{})
	for _, payload := range []string{
		`{"TEXT":"x","notify":"a@example.com"}`,
		`{"text":"a","text":"b","notify":"a@example.com"}`,
	} {
		job := &queue.Job{Message: queue.Message{JobID: uuid.NewString(), Tenant: "acme", Payload: []byte(payload), EnqueuedAt: time.Now()}, ID: "1-1", Deliveries: 1}
		_, err := h.Process(context.Background(), job)
		// onceflow decodes a job's arguments strictly before the worker runs.
		if !errors.Is(err, retry.ErrPermanent) || !errors.Is(err, onceflow.ErrUndecodable) {
			t.Fatalf("payload %s: %v, want a permanent invalid-payload error", payload, err)
		}
	}
	if client.Calls() != 0 {
		t.Fatalf("%d model calls for invalid payloads, want 0", client.Calls())
	}
}

// Redis down: POST answers 503 with Retry-After and stores nothing, so once Redis is back
// the same key is a new job; GET answers 503 for a job PostgreSQL does not know, but a
// finished job is read from PostgreSQL alone.
func TestPostAndGetWithRedisDown(t *testing.T) {
	t.Parallel()
	srvRedis, rdb := privateRedis(t)
	pool, _ := testenv.Postgres(t)
	const prefix = "onceflow"
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	base := newAPIServer(t, rdb, prefix, pool).URL
	ctx := context.Background()

	// A finished job, to read while Redis is down.
	const doneKey = "done-before-outage-01"
	doneID := jobIDOf("acme", doneKey)
	if _, err := pool.Exec(ctx, `INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'in short')`, doneID); err != nil {
		t.Fatal(err)
	}

	srvRedis.Stop()
	const key = "during-outage-000001"
	body := validBody("written while Redis was down")
	r := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body})
	if r.code != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("POST with Redis down: %d %v %s, want 503 with Retry-After", r.code, r.header, r.body)
	}
	if _, ok := r.json(t)["detail"]; !ok {
		t.Fatalf("503 body %s has no detail", r.body)
	}
	g := get(t, base, keyAcme, jobIDOf("acme", key))
	if g.code != http.StatusServiceUnavailable || g.header.Get("Retry-After") == "" || !strings.Contains(g.body, "redis") {
		t.Fatalf("GET of an unfinished job with Redis down: %d %s, want 503 naming redis", g.code, g.body)
	}
	if g := get(t, base, keyAcme, doneID); g.code != http.StatusOK || g.json(t)["status"] != "done" {
		t.Fatalf("GET of a finished job with Redis down: %d %s, want 200 done from PostgreSQL", g.code, g.body)
	}

	srvRedis.Start()
	if n, err := rdb.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Fatalf("after the outage Redis holds %d keys (%v): the refused request stored something", n, err)
	}
	r = post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: body})
	if r.code != http.StatusAccepted || r.header.Get(idempotency.HeaderReplayed) != "" {
		t.Fatalf("the same key after the outage: %d %s replayed %q, want a new 202", r.code, r.body, r.header.Get(idempotency.HeaderReplayed))
	}
	if jobs := streamJobs(t, rdb, keys); len(jobs) != 1 || jobs[0].JobID != jobIDOf("acme", key) {
		t.Fatalf("stream %+v, want the one job", jobs)
	}
}

// GET /v1/summaries/{job_id}: queued while waiting, done with the summary once a worker
// stored it, failed with the dead-letter reason, 404 for unknown ids and other tenants'
// jobs.
func TestGetJobStates(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	pool, _ := testenv.Postgres(t)
	base := newAPIServer(t, rdb, prefix, pool).URL

	postJob := func(apiKey, key, text string) string {
		t.Helper()
		r := post(t, base, request{apiKey: apiKey, idemKey: key, ctype: "application/json", body: validBody(text)})
		if r.code != http.StatusAccepted {
			t.Fatalf("POST: %d %s", r.code, r.body)
		}
		return r.json(t)["job_id"].(string)
	}
	failing := postJob(keyAcme, "job-state-failing-01", "the model refuses this one")
	finishing := postJob(keyAcme, "job-state-finishing-1", "Board meeting: budget approved, hiring paused.")
	theirs := postJob(keyGlobex, "job-state-globex-0001", "globex's own text")

	state := func(apiKey, id string) (int, map[string]any) {
		t.Helper()
		r := get(t, base, apiKey, id)
		if r.code != http.StatusOK {
			return r.code, nil
		}
		return r.code, r.json(t)
	}
	for _, id := range []string{failing, finishing} {
		if code, m := state(keyAcme, id); code != 200 || m["status"] != "queued" || m["job_id"] != id || len(m) != 2 {
			t.Fatalf("before any worker: %d %v, want queued", code, m)
		}
	}

	// Jobs run in stream order, one at a time: the first model call gets a 400.
	client := fake.New()
	client.FailNext(&llm.APIError{Provider: "openai", StatusCode: 400, Type: "invalid_request_error", Code: "context_length_exceeded", Message: "too long"})
	h := newHandler(t, pool, client, handlerConfig{})
	stop := startWorker(t, queue.WorkerConfig{Redis: rdb, Keys: keys, Handler: h, Concurrency: 1})
	testenv.WaitFor(t, 20*time.Second, "the three jobs to finish", func() bool {
		_, f := state(keyAcme, failing)
		_, d := state(keyAcme, finishing)
		_, g := state(keyGlobex, theirs)
		return f["status"] != "queued" && d["status"] != "queued" && g["status"] != "queued"
	})
	stop()

	code, m := state(keyAcme, finishing)
	var summary string
	if err := pool.QueryRow(context.Background(), `SELECT summary FROM summaries WHERE job_id = $1`, finishing).Scan(&summary); err != nil {
		t.Fatal(err)
	}
	if code != 200 || m["status"] != "done" || m["summary"] != summary || summary == "" || m["error"] != nil {
		t.Fatalf("finished job: %d %v, want done with the stored summary %q", code, m, summary)
	}
	code, m = state(keyAcme, failing)
	reason, _ := m["error"].(string)
	if code != 200 || m["status"] != "failed" || !strings.Contains(reason, "permanent") || !strings.Contains(reason, "context_length_exceeded") || m["summary"] != nil {
		t.Fatalf("dead-lettered job: %d %v, want failed with the dead-letter reason", code, m)
	}
	dead, err := queue.FindDead(context.Background(), rdb, keys, failing)
	if err != nil || len(dead) != 1 || dead[0].Reason != reason {
		t.Fatalf("dead letters %+v (%v), want one with the reason GET showed", dead, err)
	}
	if client.Calls() != 3 {
		t.Fatalf("%d model calls, want 3: one per job (a 400 is not retried)", client.Calls())
	}

	// 404: an unknown id, a malformed id, and every state of another tenant's job.
	for _, tc := range []struct{ apiKey, id string }{
		{keyAcme, uuid.NewString()},
		{keyAcme, "not-a-uuid"},
		{keyAcme, strings.ToUpper(finishing)},
		{keyAcme, theirs},
		{keyGlobex, finishing},
		{keyGlobex, failing},
	} {
		r := get(t, base, tc.apiKey, tc.id)
		if r.code != http.StatusNotFound || r.json(t)["detail"] == nil {
			t.Fatalf("GET %s: %d %s, want 404", tc.id, r.code, r.body)
		}
	}
	if code, m := state(keyGlobex, theirs); code != 200 || m["status"] != "done" {
		t.Fatalf("globex's own job: %d %v", code, m)
	}
	if r := get(t, base, "nobody-0123456789abcdef", finishing); r.code != http.StatusUnauthorized {
		t.Fatalf("GET with an unknown key: %d", r.code)
	}
	// Other methods: 405 with Allow, in the same JSON error format.
	req, _ := http.NewRequest(http.MethodDelete, base+"/v1/summaries/"+finishing, nil)
	req.Header.Set("Authorization", "Bearer "+keyAcme)
	if r := do(t, req); r.code != http.StatusMethodNotAllowed || r.header.Get("Allow") != "GET, HEAD" || r.json(t)["detail"] == nil {
		t.Fatalf("DELETE a job: %d %v %s, want 405 with Allow and a JSON detail", r.code, r.header, r.body)
	}
}

// PostgreSQL down: GET answers 503 with Retry-After (it must ask PostgreSQL first), while
// accepting a job needs only Redis.
func TestGetWithPostgresDown(t *testing.T) {
	t.Parallel()
	srvPG := testenv.PrivatePostgres(t)
	ctx := context.Background()
	dsn := testenv.PostgresURLOf(srvPG)
	if _, err := migrations.Up(ctx, dsn, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	pool, err := connect.Postgres(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	rdb, prefix := testenv.Redis(t)
	base := newAPIServer(t, rdb, prefix, pool).URL

	r := post(t, base, request{apiKey: keyAcme, idemKey: "pg-down-key-00000001", ctype: "application/json", body: validBody("text")})
	if r.code != http.StatusAccepted {
		t.Fatalf("POST: %d %s", r.code, r.body)
	}
	id := r.json(t)["job_id"].(string)
	if g := get(t, base, keyAcme, id); g.code != 200 || g.json(t)["status"] != "queued" {
		t.Fatalf("GET with PostgreSQL up: %d %s", g.code, g.body)
	}

	srvPG.Stop()
	g := get(t, base, keyAcme, id)
	if g.code != http.StatusServiceUnavailable || g.header.Get("Retry-After") == "" || !strings.Contains(g.body, "postgres") {
		t.Fatalf("GET with PostgreSQL down: %d %v %s, want 503 naming postgres", g.code, g.header, g.body)
	}
	r = post(t, base, request{apiKey: keyAcme, idemKey: "pg-down-key-00000002", ctype: "application/json", body: validBody("text")})
	if r.code != http.StatusAccepted {
		t.Fatalf("POST with PostgreSQL down: %d %s, want 202 (accepting needs only Redis)", r.code, r.body)
	}
	if n := rdb.XLen(ctx, queue.Keys{Prefix: prefix, Queue: summaries.QueueName}.Stream()).Val(); n != 2 {
		t.Fatalf("%d stream entries, want 2", n)
	}
}

// A POST whose text holds U+0000 (JSON "\u0000", valid JSON and valid UTF-8) is either
// refused with 400 naming text, or completes: never accepted (202) and then
// dead-lettered after MaxDeliveries model calls because its summary (which quotes the
// text, as a model asked to repeat it may) cannot be stored in PostgreSQL's text.
func TestTextWithNULIsRefusedOrCompleted(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	p := newPipelineOn(t, rdb, prefix)
	srv := newAPIServer(t, rdb, prefix, p.pool)
	r := post(t, srv.URL, request{apiKey: keyAcme, idemKey: "nul-text-key-00000001", ctype: "application/json",
		body: `{"text":"Invoice\u0000 charged twice, refund by Friday.","notify":"team@example.com"}`})
	if r.code == 400 {
		if m := r.json(t); m["detail"] == nil {
			t.Fatalf("400 without a detail: %s", r.body)
		}
		return // refused up front: fine
	}
	if r.code != 202 {
		t.Fatalf("POST: %d %s", r.code, r.body)
	}
	jobID := jobIDOf("acme", "nul-text-key-00000001")
	model := fake.New()
	rec := &recorder{h: newHandler(t, p.pool, model, handlerConfig{Retry: fastRetries})}
	stop := startWorker(t, queue.WorkerConfig{Redis: p.rdb, Keys: p.keys, Handler: rec, ClaimIdle: 50 * time.Millisecond, MaxDeliveries: 3})
	testenv.WaitFor(t, 20*time.Second, "the job to complete or be dead-lettered", func() bool {
		return len(p.dead(jobID)) > 0 || count(t, p.pool, `SELECT count(*) FROM summaries WHERE job_id = $1`, jobID) == 1
	})
	stop()
	if d := p.dead(jobID); len(d) > 0 {
		t.Fatalf("accepted with 202, then dead-lettered after %d runs (%d model calls): %s", len(rec.Runs()), model.Calls(), d[0].Reason)
	}
}

// run is one handler run: its outcome and error, and the delivery it was.
type run struct {
	outcome    summaries.Outcome
	err        error
	deliveries int64
	at         time.Time
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
	srvRedis, rdb := privateRedis(t)
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

// A worker is killed (kill -9) after the model answered and before its Commit
// committed: the answer, recorded only with the Commit, is gone with it, and the call's
// row is in_flight as the worker's insert left it. The next worker takes the row over
// once its lease ends, counts the lost attempt as ambiguous, asks again and commits
// once: two model calls, one summary, one outbox row, one email.
//
// To put the kill there without racing, a trigger makes the Commit's summary insert
// wait for an advisory lock the test holds; the test kills the worker, then ends its
// PostgreSQL session (as PostgreSQL does when it finds the client gone), so the
// transaction rolls back.
func TestWorkerKilledBetweenTheAnswerAndItsCommitAsksAgainOnce(t *testing.T) {
	t.Parallel()
	srvRedis, rdb := privateRedis(t)
	p := newPipelineOn(t, rdb, "onceflow")
	ctx := context.Background()
	lock, err := p.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Release()
	if _, err := lock.Exec(ctx, `
		CREATE FUNCTION wait_for_the_test() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock(hashtext(current_schema())); RETURN NEW; END $$;
		CREATE TRIGGER wait_for_the_test BEFORE INSERT ON summaries FOR EACH ROW EXECUTE FUNCTION wait_for_the_test();
		SELECT pg_advisory_lock(hashtext(current_schema()));`); err != nil {
		t.Fatal(err)
	}
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	modelSrv := httptest.NewServer(fs)
	t.Cleanup(modelSrv.Close)
	env := []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURLOf(srvRedis), "ONCEFLOW_DATABASE_URL=" + p.dsn,
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + modelSrv.URL + "/v1", "OPENAI_API_KEY=test-key",
		"ONCEFLOW_LEDGER_LEASE=1s", "ONCEFLOW_CLAIM_IDLE=1s",
	}

	const jobID = "00000000-0000-4000-8000-00000000c0a2"
	p.enqueue(jobID, "Incident review: the cache expired at 09:12 and the database took the load.")
	a := testenv.Start(t, testenv.Binary(t), env, "work")
	var backend int
	testenv.WaitFor(t, 30*time.Second, "worker a's Commit to wait in the trigger", func() bool {
		// Only this test's schema has the trigger: no other summary insert waits so.
		err := p.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
			WHERE wait_event = 'advisory' AND query LIKE '%INSERT INTO summaries%' AND datname = current_database()`).Scan(&backend)
		return err == nil
	})
	var state string
	var attempt, ambiguous int
	if err := p.pool.QueryRow(ctx, `SELECT state, attempt, ambiguous FROM llm_calls`).Scan(&state, &attempt, &ambiguous); err != nil || state != ledger.StateInFlight {
		t.Fatalf("while the Commit waits: the call's row %s (%v), want in_flight (its answer goes in with the Commit)", state, err)
	}
	a.Kill()
	if _, err := p.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, backend); err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, `SELECT pg_advisory_unlock(hashtext(current_schema()))`); err != nil {
		t.Fatal(err)
	}
	if n := count(t, p.pool, `SELECT count(*) FROM summaries`); n != 0 {
		t.Fatalf("%d summaries after the kill, want 0: the Commit did not happen", n)
	}

	b := testenv.Start(t, testenv.Binary(t), env, "work")
	testenv.WaitFor(t, 60*time.Second, "worker b's summary", func() bool {
		return count(t, p.pool, `SELECT count(*) FROM summaries WHERE job_id = $1`, jobID) == 1 && len(p.pending()) == 0
	})
	b.Signal(syscall.SIGTERM)
	b.Wait(30 * time.Second)
	if err := p.pool.QueryRow(ctx, `SELECT state, attempt, ambiguous FROM llm_calls`).Scan(&state, &attempt, &ambiguous); err != nil ||
		state != ledger.StateSucceeded || attempt != 2 || ambiguous != 1 {
		t.Fatalf("the call's row: %s attempt %d ambiguous %d (%v); want succeeded in attempt 2 after 1 ambiguous", state, attempt, ambiguous, err)
	}
	if n := fs.Stats().Requests; n != 2 {
		t.Fatalf("%d model calls, want 2: the answer lost with the worker is asked again", n)
	}
	relay := p.relay(outbox.Config{})
	if r := p.pass(relay); r.Sent != 1 {
		t.Fatalf("relay pass %+v, want one sent", r)
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

func h2Job(t *testing.T, jobID string) *queue.Job {
	t.Helper()
	payload, err := json.Marshal(summaries.Request{Text: "The March invoice was charged twice.", Notify: "ops@example.com"})
	if err != nil {
		t.Fatal(err)
	}
	return &queue.Job{Message: queue.Message{JobID: jobID, Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}, ID: "1-1", Deliveries: 1}
}

// h2Policy is two attempts per delivery with short sleeps.
var h2Policy = retry.Policy{MaxAttempts: 2, Base: 10 * time.Millisecond, Cap: 50 * time.Millisecond, MinAttempt: 100 * time.Millisecond}

// The summary's model step is streamed: a reset before the answer's headers is retried
// within the delivery (nothing was yielded), a reset mid-body ends the delivery (its
// text was yielded, and passed on to the job's events), and the redelivery finishes.
func TestHTTP2ResetLeavesTheJobForRedelivery(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// faults are the first requests' faults; requests and ambiguous are the model's
		// requests and the ledger's ambiguous attempts after the failed delivery.
		faults              []h2fault.Fault
		requests, ambiguous int
	}{
		{"RST_STREAM before headers", []h2fault.Fault{h2fault.ResetBeforeHeaders, h2fault.ResetBeforeHeaders}, 2, 2},
		{"RST_STREAM mid-body", []h2fault.Fault{h2fault.ResetMidBody}, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := testenv.Postgres(t)
			fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			srv := h2fault.Start(t, fs, tc.faults...)
			model := openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "sk-test", HTTPClient: srv.Client()})
			l, err := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			h := newHandler(t, pool, model, handlerConfig{Provider: "openai", Ledger: l, Retry: h2Policy})
			job := h2Job(t, uuid.NewString())

			err = h.Handle(context.Background(), job)
			if err == nil || errors.Is(err, retry.ErrPermanent) || !retry.Transient(err) {
				t.Fatalf("Handle: %v, want a transient error that leaves the job pending (not retry.ErrPermanent)", err)
			}
			if srv.Requests() != tc.requests {
				t.Fatalf("the model saw %d requests, want %d", srv.Requests(), tc.requests)
			}
			if n := count(t, pool, `SELECT count(*) FROM summaries`); n != 0 {
				t.Fatalf("%d summaries after a failed delivery", n)
			}
			// The resets came after the request arrived: every attempt is ambiguous.
			if st := h2LedgerStats(t, pool); st.Ambiguous != int64(tc.ambiguous) || st.InFlight != 1 || st.Failed != 0 {
				t.Fatalf("ledger %+v, want one in-flight row with %d ambiguous attempts", st, tc.ambiguous)
			}

			// The redelivery succeeds: one summary, one email intent, one more request.
			job.Deliveries = 2
			if o, err := h.Process(context.Background(), job); err != nil || o != summaries.OutcomeDone {
				t.Fatalf("redelivery: %q, %v", o, err)
			}
			if srv.Requests() != tc.requests+1 || count(t, pool, `SELECT count(*) FROM summaries`) != 1 || count(t, pool, `SELECT count(*) FROM outbox`) != 1 {
				t.Fatalf("after the redelivery: %d requests, want %d, and one summary with one outbox row", srv.Requests(), tc.requests+1)
			}
		})
	}
}

func TestHTTP2GoAwayBelowTheStreamIsAClearFailure(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	srv := h2fault.StartGoAway(t, h2fault.GoAwayUnprocessed)
	model := openai.New(openai.Config{BaseURL: srv.URL + "/v1", APIKey: "sk-test", HTTPClient: srv.Client()})
	l, err := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	h := newHandler(t, pool, model, handlerConfig{Provider: "openai", Ledger: l, Retry: h2Policy})
	_, err = h.Process(context.Background(), h2Job(t, uuid.NewString()))
	if err == nil || errors.Is(err, retry.ErrPermanent) || !retry.Transient(err) {
		t.Fatalf("Process: %v, want a transient error that leaves the job pending", err)
	}
	if srv.Requests() != 2 {
		t.Fatalf("the model saw %d requests, want 2", srv.Requests())
	}
	// The server said it processed neither: no ambiguous attempt, the row is failed.
	if st := h2LedgerStats(t, pool); st.Ambiguous != 0 || st.InFlight != 0 || st.Failed != 1 {
		t.Fatalf("ledger %+v, want one failed row, no ambiguous attempt", st)
	}
}

func h2LedgerStats(t *testing.T, pool ledger.DB) ledger.Stats {
	t.Helper()
	st, err := ledger.ReadStats(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != 1 {
		t.Fatalf("ledger stats %+v, want one provider and model", st)
	}
	return st[0]
}

// lgEnv is one test's queue, database, model and ledger.
type lgEnv struct {
	rdb    *redis.Client
	keys   queue.Keys
	pool   *pgxpool.Pool
	fake   *fakeserver.Server
	gate   *lgGate
	model  *openai.Client
	ledger *ledger.Ledger
}

// lgGate holds the first model request until Release, so a test can act while a call
// is in flight; later requests pass.
type lgGate struct {
	next    http.Handler
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
	mu      sync.Mutex
	n       int
}

func (g *lgGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.mu.Lock()
	g.n++
	first := g.n == 1
	g.mu.Unlock()
	if first {
		g.arrived <- struct{}{}
		<-g.release
	}
	g.next.ServeHTTP(w, r)
}

func (g *lgGate) Release() { g.once.Do(func() { close(g.release) }) }

func (g *lgGate) requests() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

func (e *lgEnv) enqueue(t *testing.T, jobID, text string) {
	t.Helper()
	payload, _ := json.Marshal(summaries.Request{Text: text, Notify: "ops@example.com"})
	if _, err := queue.Enqueue(context.Background(), e.rdb, e.keys, queue.Message{JobID: jobID, Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
}

// lgOutcome is one run of the handler.
type lgOutcome struct {
	outcome    summaries.Outcome
	err        error
	deliveries int64
}

// lgRecorder runs a handler and records what each run returned.
type lgRecorder struct {
	h    *testHandler
	mu   sync.Mutex
	runs []lgOutcome
}

func (r *lgRecorder) Handle(ctx context.Context, job *queue.Job) error {
	out, err := r.h.Process(ctx, job)
	r.mu.Lock()
	r.runs = append(r.runs, lgOutcome{out, err, job.Deliveries})
	r.mu.Unlock()
	return err
}

func (r *lgRecorder) Runs() []lgOutcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]lgOutcome(nil), r.runs...)
}

func (e *lgEnv) handler(t *testing.T, withLedger bool) *lgRecorder {
	t.Helper()
	cfg := handlerConfig{Model: "gpt-4.1-mini", Provider: "openai", Logger: testenv.Logger(t),
		Retry: retry.Policy{Base: 10 * time.Millisecond, Cap: 50 * time.Millisecond, MinAttempt: 100 * time.Millisecond}}
	if withLedger {
		cfg.Ledger, cfg.LedgerConfig = e.ledger, ledger.Config{Wait: 30 * time.Second}
	}
	h := newHandler(t, e.pool, e.model, cfg)
	return &lgRecorder{h: h}
}

func (e *lgEnv) worker(t *testing.T, h queue.Handler, consumer string, claimIdle time.Duration) (stop func()) {
	t.Helper()
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.rdb, Keys: e.keys, Handler: h, Consumer: consumer,
		ClaimIdle: claimIdle, RenewInterval: -1, ClaimInterval: 50 * time.Millisecond, Block: 100 * time.Millisecond,
		ShutdownTimeout: 5 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

func (e *lgEnv) rows(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A slow worker and a reclaimer on one job (docs/queue.md's case): worker a is still waiting
// for the model when worker b reclaims the entry. With the ledger, b finds a's call in
// flight (a renews its lease) and waits for it instead of calling too; when a's answer
// is recorded, b replays it. ONE model call (without the ledger, the pipeline suite's
// TestSlowWorkerAndReclaimer counts two; the subtest "without ledger" shows it here), one
// summary, one outbox row: results done (a) and duplicate (b).
func TestSlowWorkerAndReclaimerMakeOneModelCallWithTheLedger(t *testing.T) {
	t.Parallel()
	for _, withLedger := range []bool{true, false} {
		t.Run(fmt.Sprintf("ledger=%v", withLedger), func(t *testing.T) {
			t.Parallel()
			e := lgSetup(t)
			const jobID = "00000000-0000-4000-8000-00000000a701"
			e.enqueue(t, jobID, "A slow model call.")
			a := e.handler(t, withLedger)
			stopA := e.worker(t, a, "worker-a", time.Hour)
			select {
			case <-e.gate.arrived:
			case <-time.After(30 * time.Second):
				t.Fatal("worker a never called the model")
			}
			b := e.handler(t, withLedger)
			stopB := e.worker(t, b, "worker-b", 300*time.Millisecond)
			if withLedger {
				// b reclaims the entry and reaches the ledger, where a's call is in flight:
				// it waits. Give it time to do something wrong (call the model) if it would.
				testenv.WaitFor(t, 30*time.Second, "worker b to reclaim the entry", func() bool {
					p, _ := e.rdb.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: e.keys.Stream(), Group: queue.DefaultGroup, Start: "-", End: "+", Count: 1}).Result()
					return len(p) == 1 && p[0].Consumer == "worker-b"
				})
				time.Sleep(500 * time.Millisecond)
				if n := e.gate.requests(); n != 1 || len(b.Runs()) > 0 {
					t.Fatalf("while a's call was in flight, b made %d model calls and finished %+v", n-1, b.Runs())
				}
				e.gate.Release()
			} else {
				testenv.WaitFor(t, 30*time.Second, "worker b to finish", func() bool { return len(b.Runs()) == 1 })
				e.gate.Release()
			}
			testenv.WaitFor(t, 30*time.Second, "both workers to finish", func() bool { return len(a.Runs()) == 1 && len(b.Runs()) == 1 })
			stopA()
			stopB()

			calls := e.fake.Stats().Requests
			ra, rb := a.Runs()[0], b.Runs()[0]
			if ra.err != nil || rb.err != nil || rb.deliveries != 2 {
				t.Fatalf("worker a %+v, worker b %+v", ra, rb)
			}
			if withLedger {
				// Both get the one recorded answer once a's call ends; which of them then
				// commits first is a race (a usually, b when its poll of the ledger lands
				// right after a's record and a is descheduled): one done, one duplicate.
				done := map[summaries.Outcome]int{ra.outcome: 1}
				done[rb.outcome]++
				if calls != 1 || done[summaries.OutcomeDone] != 1 || done[summaries.OutcomeDuplicate] != 1 {
					t.Fatalf("with the ledger: %d model calls, a %s, b %s; want 1, one done and one duplicate", calls, ra.outcome, rb.outcome)
				}
				st, err := ledger.ReadStats(context.Background(), e.pool)
				if err != nil || len(st) != 1 || st[0].Succeeded != 1 || st[0].Attempts != 1 || st[0].Ambiguous != 0 {
					t.Fatalf("ledger %+v %v", st, err)
				}
			} else if calls != 2 || ra.outcome != summaries.OutcomeDuplicate || rb.outcome != summaries.OutcomeDone {
				t.Fatalf("without the ledger: %d model calls, a %s, b %s; want 2, duplicate, done", calls, ra.outcome, rb.outcome)
			}
			if s, o := e.rows(t, `SELECT count(*) FROM summaries`), e.rows(t, `SELECT count(*) FROM outbox`); s != 1 || o != 1 {
				t.Fatalf("%d summaries, %d outbox rows", s, o)
			}
		})
	}
}

// The model answered and its answer was recorded, then the summary's transaction failed
// (a trigger makes the INSERT fail, as a constraint, a full disk or a failover would):
// the job stays pending, and its redelivery replays the recorded answer. ONE model call.
// Without the ledger the redelivery calls the model again (the control subtest).
func TestSummaryTransactionFailedAfterTheCallRedeliveryDoesNotCallTheModel(t *testing.T) {
	t.Parallel()
	for _, withLedger := range []bool{true, false} {
		t.Run(fmt.Sprintf("ledger=%v", withLedger), func(t *testing.T) {
			t.Parallel()
			e := lgSetup(t)
			e.gate.Release() // no gating here
			ctx := context.Background()
			for _, sql := range []string{
				`CREATE TABLE fail_summaries (reason text)`,
				`CREATE FUNCTION fail_summary() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					IF EXISTS (SELECT 1 FROM fail_summaries) THEN RAISE EXCEPTION 'injected: the summary transaction fails'; END IF;
					RETURN NEW;
				END $$`,
				`CREATE TRIGGER fail_summary BEFORE INSERT ON summaries FOR EACH ROW EXECUTE FUNCTION fail_summary()`,
				`INSERT INTO fail_summaries VALUES ('first delivery')`,
			} {
				if _, err := e.pool.Exec(ctx, sql); err != nil {
					t.Fatal(err)
				}
			}
			const jobID = "00000000-0000-4000-8000-00000000a702"
			e.enqueue(t, jobID, "The quarter in three lines.")
			h := e.handler(t, withLedger)
			e.worker(t, h, "worker", 500*time.Millisecond)
			testenv.WaitFor(t, 30*time.Second, "the first delivery to fail", func() bool { return len(h.Runs()) >= 1 })
			if r := h.Runs()[0]; r.err == nil || r.deliveries != 1 || e.fake.Stats().Requests != 1 {
				t.Fatalf("first delivery: %+v after %d model calls", r, e.fake.Stats().Requests)
			}
			if _, err := e.pool.Exec(ctx, `DELETE FROM fail_summaries`); err != nil { // the database recovers
				t.Fatal(err)
			}
			testenv.WaitFor(t, 30*time.Second, "the redelivery to store the summary", func() bool {
				runs := h.Runs()
				return len(runs) > 0 && runs[len(runs)-1].outcome == summaries.OutcomeDone
			})
			runs := h.Runs()
			calls := e.fake.Stats().Requests
			want := int64(1)
			if !withLedger {
				want = int64(len(runs)) // every delivery paid for a call
			}
			if calls != want || len(runs) < 2 {
				t.Fatalf("%d model calls over %d deliveries, want %d", calls, len(runs), want)
			}
			if withLedger && calls != 1 {
				t.Fatalf("the redelivery called the model")
			}
			if s, o := e.rows(t, `SELECT count(*) FROM summaries`), e.rows(t, `SELECT count(*) FROM outbox`); s != 1 || o != 1 {
				t.Fatalf("%d summaries, %d outbox rows", s, o)
			}
		})
	}
}

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

// A client re-sends a key after its stored response expired, for a job
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

// Options.Sender is the workflow's sender of its one topic; without it the workflow has
// none (its emails wait for a process that has one).
func TestWorkflowSendsItsTopicWithOptionsSender(t *testing.T) {
	t.Parallel()
	s := outbox.LogSender{}
	wf := summaries.Workflow(summaries.Options{Sender: s})
	if len(wf.Senders) != 1 || wf.Senders[summaries.TopicSummaryReady] != s {
		t.Fatalf("Senders %v, want only %s", wf.Senders, summaries.TopicSummaryReady)
	}
	if wf := summaries.Workflow(summaries.Options{}); len(wf.Senders) != 0 {
		t.Fatalf("Senders %v without Options.Sender, want none", wf.Senders)
	}
}

// Messages already in the stream when the service is upgraded were written in the wire
// format of the releases before job kinds (version 1: no kind field). The summaries
// queue's DefaultKind routes them to the summary worker: each is summarised, committed
// with its one email intent, and the email sent once, as a new message would be.
func TestV1MessagesInTheStreamAreStillProcessed(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}

	// The old producer's entries, field by field as the releases before kinds XADDed
	// them (v, job_id, tenant, payload, enqueued_at, traceparent), with no job index.
	ids := []string{"6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c0001", "6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c0002"}
	for i, id := range ids {
		payload, _ := json.Marshal(summaries.Request{Text: "Report " + strconv.Itoa(i) + ": revenue grew.", Notify: "ops@example.com"})
		err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Stream(), Values: []any{
			"v", "1", "job_id", id, "tenant", "acme", "payload", string(payload),
			"enqueued_at", strconv.FormatInt(time.Now().UnixMilli(), 10), "traceparent", "",
		}}).Err()
		if err != nil {
			t.Fatal(err)
		}
	}
	// And one through today's queue.Enqueue of a message without a kind, which writes
	// version 1 with its job index.
	third := "6f1c1f3e-0d5b-5a53-9d6e-3b3a7f1c0003"
	payload, _ := json.Marshal(summaries.Request{Text: "Report 2: churn fell.", Notify: "ops@example.com"})
	if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: third, Tenant: "acme", Payload: payload, EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, third)
	if fields, _ := rdb.XRange(ctx, keys.Stream(), "-", "+").Result(); len(fields) != 3 || fields[0].Values["kind"] != nil || fields[2].Values["kind"] != nil {
		t.Fatalf("stream %v: want 3 entries without a kind field", fields)
	}

	var mu sync.Mutex
	sent := map[string]int{}
	model := fake.New()
	c, err := onceflow.NewClient(onceflow.Config{
		Redis: rdb, DB: pool, Prefix: prefix, Model: model, Provider: "fake", Logger: testenv.Logger(t),
		Relay: outbox.Config{PollInterval: 20 * time.Millisecond},
		Senders: map[string]outbox.Sender{summaries.TopicSummaryReady: outbox.SenderFunc(func(_ context.Context, m outbox.Message) error {
			mu.Lock()
			sent[m.DedupeKey]++
			mu.Unlock()
			return nil
		})},
		Workflows: []onceflow.Workflow{summaries.Workflow(summaries.Options{Tenant: bearerTenant, Logger: testenv.Logger(t)})},
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	testenv.WaitFor(t, 20*time.Second, "three emails", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(sent) == 3
	})
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if n := count(t, pool, `SELECT count(*) FROM summaries WHERE job_id = $1 AND tenant = 'acme'`, id); n != 1 {
			t.Errorf("job %s: %d summaries, want 1", id, n)
		}
		if n := count(t, pool, `SELECT count(*) FROM job_completions WHERE job_id = $1 AND kind = $2`, id, summaries.JobKind); n != 1 {
			t.Errorf("job %s: %d completion records of kind %s, want 1", id, n, summaries.JobKind)
		}
		if n := count(t, pool, `SELECT count(*) FROM outbox WHERE dedupe_key = $1`, summaries.DedupeKey(id)); n != 1 {
			t.Errorf("job %s: %d outbox rows, want 1", id, n)
		}
		if sent[summaries.DedupeKey(id)] != 1 {
			t.Errorf("job %s: %d emails, want 1", id, sent[summaries.DedupeKey(id)])
		}
	}
	if model.Calls() != 3 {
		t.Errorf("%d model calls, want 3", model.Calls())
	}
	st, err := queue.ReadStats(ctx, rdb, keys, queue.DefaultGroup)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 0 || st.Dead != 0 {
		t.Fatalf("queue after the run: %d pending, %d dead-lettered, want none", st.Pending, st.Dead)
	}
}

// GET /v1/summaries/{job_id}/events streams the summary's text (the model step is
// streamed through the ledger) and ends with the job's state; another tenant gets 404.
func TestSummaryEventsStreamTheTextAndTheEnd(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	pool, _ := testenv.Postgres(t)
	base := newAPIServer(t, rdb, prefix, pool).URL
	const key = "summary-events-key-0001"
	if r := post(t, base, request{apiKey: keyAcme, idemKey: key, ctype: "application/json", body: validBody("The quarter went well.")}); r.code != http.StatusAccepted {
		t.Fatalf("POST: %d %s", r.code, r.body)
	}
	jobID := jobIDOf("acme", key)
	events := func(apiKey string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, base+"/v1/summaries/"+jobID+"/events", nil)
		req.Header.Set("Authorization", "Bearer "+apiKey)
		r := do(t, req)
		return r.code, r.body
	}
	if code, _ := events(keyGlobex); code != http.StatusNotFound {
		t.Fatalf("another tenant's events: %d, want 404", code)
	}
	l, err := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	h := newHandler(t, pool, fake.New(), handlerConfig{Provider: "openai", Ledger: l})
	stop := startWorker(t, queue.WorkerConfig{Redis: rdb, Keys: keys, Handler: h, Concurrency: 1})
	defer stop()
	code, body := events(keyAcme)
	if code != http.StatusOK {
		t.Fatalf("events: %d %s", code, body)
	}
	var text strings.Builder
	var last string
	for _, line := range strings.Split(body, "\n") {
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			var d struct {
				Text   string `json:"text"`
				Status string `json:"status"`
			}
			if err := json.Unmarshal([]byte(data), &d); err != nil {
				t.Fatalf("data %s: %v", data, err)
			}
			text.WriteString(d.Text)
			last = d.Status
		}
	}
	r := get(t, base, keyAcme, jobID).json(t)
	if text.String() == "" || text.String() != r["summary"] || last != "done" {
		t.Fatalf("events' text %q (last status %q); GET says %v", text.String(), last, r)
	}
}
