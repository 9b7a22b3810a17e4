package summaries_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

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
	inspect, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	serverRedis, err := connect.Redis(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { serverRedis.Close() })
	var rt roundtrip.Counter
	serverRedis.AddHook(&rt)
	pool, _ := testenv.Postgres(t)
	base := newAPIServer(t, serverRedis, prefix, pool).URL
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
	inspect, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	serverRedis, err := connect.Redis(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { serverRedis.Close() })
	var rt roundtrip.Counter
	serverRedis.AddHook(&rt)
	pool, _ := testenv.Postgres(t)
	base := newAPIServer(t, serverRedis, prefix, pool).URL

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
	srvRedis := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srvRedis))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
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
