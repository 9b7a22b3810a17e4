package redisstore_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
)

// Accept a job in one round trip: the first call enqueues and stores the response, a
// retry with the same key and fingerprint replays it without enqueueing again, and the
// same key with another request is refused.
func ExampleStore_Accept() {
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	ctx := context.Background()
	prefix := "example" + idempotency.NewToken()[:8]
	stream := prefix + ":{summaries}:stream" // the hash tag places the record in the stream's slot
	defer rdb.Del(ctx, stream, prefix+":{summaries}:job:job-1")

	store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix, ResultTTL: time.Hour})
	if err != nil {
		panic(err)
	}
	scope := idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/summaries", Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"}
	key, _ := store.AcceptKey(stream, scope)
	defer rdb.Del(ctx, key)

	canonical, _ := idempotency.CanonicalJSON([]byte(`{"text": "hello", "notify": "a@example.com"}`))
	resp := &idempotency.Response{
		Status: http.StatusAccepted,
		Header: http.Header{"Location": {"/v1/summaries/job-1"}},
		Body:   []byte(`{"job_id":"job-1","status":"queued"}`),
	}
	enqueue := redisstore.Enqueue{
		Stream:      stream,
		Fields:      []any{"v", "1", "job_id", "job-1", "tenant", "acme", "payload", string(canonical), "enqueued_at", "0", "traceparent", ""},
		IndexKey:    prefix + ":{summaries}:job:job-1",
		IndexFields: []any{"tenant", "acme"},
		IndexTTL:    time.Hour,
	}
	for range 2 {
		got, replayed, err := store.Accept(ctx, scope, idempotency.Fingerprint(canonical), resp, enqueue)
		fmt.Println(got.Status, string(got.Body), "replayed:", replayed, "err:", err)
	}
	_, _, err = store.Accept(ctx, scope, idempotency.Fingerprint([]byte(`{"text":"other"}`)), resp, enqueue)
	fmt.Println(err)
	fmt.Println("stream entries:", rdb.XLen(ctx, stream).Val())
	// Output:
	// 202 {"job_id":"job-1","status":"queued"} replayed: false err: <nil>
	// 202 {"job_id":"job-1","status":"queued"} replayed: true err: <nil>
	// idempotency key reused with a different request
	// stream entries: 1
}
