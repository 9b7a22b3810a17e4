package summaries_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// A POST whose text holds U+0000 (JSON "\u0000", valid JSON and valid UTF-8) must either
// be refused with 400 naming text, or complete. Today it is accepted (202), and its
// summary (which quotes the text, as a model asked to repeat it may) can never be stored:
// PostgreSQL's text refuses NUL, so every delivery calls the model and fails, and the
// job is dead-lettered after MaxDeliveries model calls.
func TestAttackTextWithNULIsRefusedOrCompleted(t *testing.T) {
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

// A 400 names the field, briefly. A value nested past the decoder's depth limit under
// "text" is answered with a "field" that is the whole nesting path, garbled (20 KB of
// "text.:{.:{....a.a.a"), and an unknown member's name is echoed whole, however long:
// the detail should name "text" (or the first characters of the unknown name).
func TestAttackFieldErrorsNameTheFieldBriefly(t *testing.T) {
	t.Parallel()
	deep := strings.Repeat(`{"a":`, 20000) + "1" + strings.Repeat("}", 20000)
	for name, body := range map[string]string{
		"deeply nested text": `{"text":` + deep + `,"notify":"team@example.com"}`,
		"long unknown name":  `{"text":"x","notify":"team@example.com","x` + strings.Repeat("y", 100_000) + `":1}`,
	} {
		_, err := summaries.DecodeRequest([]byte(body))
		var fe *summaries.FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("%s: %v, want a FieldError", name, err)
		}
		if len(fe.Error()) > 1024 {
			t.Errorf("%s: the 400 detail is %d bytes: %.80q...", name, len(fe.Error()), fe.Error())
		}
		if name == "deeply nested text" && fe.Field != "text" {
			t.Errorf("%s: field %.80q..., want text", name, fe.Field)
		}
	}
}
