package summaries_test

// A model call that meets an HTTP/2 failure at the provider's edge (issue 12): the job
// must be left for redelivery, not dead-lettered, and the llm_calls ledger must count
// the attempts as ambiguous exactly when the server may have processed them. Real
// PostgreSQL, the real OpenAI adapter over TLS HTTP/2 (internal/testenv/h2fault), fake-llm
// behind it.

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/h2fault"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

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

func TestHTTP2ResetLeavesTheJobForRedelivery(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		fault h2fault.Fault
	}{
		{"RST_STREAM before headers", h2fault.ResetBeforeHeaders},
		{"RST_STREAM mid-body", h2fault.ResetMidBody},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := testenv.Postgres(t)
			fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			srv := h2fault.Start(t, fs, tc.fault, tc.fault) // the first delivery's two attempts fail
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
			if srv.Requests() != 2 {
				t.Fatalf("the model saw %d requests, want 2 (both attempts of the delivery)", srv.Requests())
			}
			if n := count(t, pool, `SELECT count(*) FROM summaries`); n != 0 {
				t.Fatalf("%d summaries after a failed delivery", n)
			}
			// The resets came after the request arrived: both attempts are ambiguous.
			if st := h2LedgerStats(t, pool); st.Ambiguous != 2 || st.InFlight != 1 || st.Failed != 0 {
				t.Fatalf("ledger %+v, want one in-flight row with 2 ambiguous attempts", st)
			}

			// The redelivery succeeds: one summary, one email intent, one more request.
			job.Deliveries = 2
			if o, err := h.Process(context.Background(), job); err != nil || o != summaries.OutcomeDone {
				t.Fatalf("redelivery: %q, %v", o, err)
			}
			if srv.Requests() != 3 || count(t, pool, `SELECT count(*) FROM summaries`) != 1 || count(t, pool, `SELECT count(*) FROM outbox`) != 1 {
				t.Fatalf("after the redelivery: %d requests, want 3, and one summary with one outbox row", srv.Requests())
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
