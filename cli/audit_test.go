package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/summaries"
)

// auditReport is what `onceflow audit --json` prints: the fields docs/operations.md lists, decoded
// strictly so that a renamed field fails the test.
type auditReport struct {
	Summaries       *int64   `json:"summaries"`
	OutboxTotal     *int64   `json:"outbox_total"`
	OutboxSent      *int64   `json:"outbox_sent"`
	OutboxUnsent    *int64   `json:"outbox_unsent"`
	OutboxExhausted *int64   `json:"outbox_exhausted"`
	DLQ             *int64   `json:"dlq"`
	StreamLength    *int64   `json:"stream_length"`
	StreamPending   *int64   `json:"stream_pending"`
	Violations      []string `json:"violations"`
	// Beyond the documented fields: the ledger's figures per provider and model.
	LLMCalls []ledger.Stats `json:"llm_calls"`
}

func (r auditReport) counts() string {
	v := func(p *int64) string {
		if p == nil {
			return "missing"
		}
		return fmt.Sprint(*p)
	}
	return fmt.Sprintf("summaries=%s outbox_total=%s outbox_sent=%s outbox_unsent=%s outbox_exhausted=%s dlq=%s stream_pending=%s",
		v(r.Summaries), v(r.OutboxTotal), v(r.OutboxSent), v(r.OutboxUnsent), v(r.OutboxExhausted), v(r.DLQ), v(r.StreamPending))
}

// `onceflow audit` on a clean pipeline exits 0 with the documented JSON fields; each kind
// of violation, planted one after the other, is reported (exit 4, --json naming it) next
// to the ones planted before.
func TestAuditReportsEachPlantedViolation(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	pool, dsn := testenv.Postgres(t)
	ctx := context.Background()
	const claimIdle = 200 * time.Millisecond
	env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_CLAIM_IDLE=" + claimIdle.String(), "ONCEFLOW_AUDIT_MAX_AGE=10m"}
	bin := testenv.Binary(t)
	audit := func(wantCode int) auditReport {
		t.Helper()
		p := testenv.Start(t, bin, env, "audit", "--json")
		code := p.Wait(20 * time.Second)
		dec := json.NewDecoder(strings.NewReader(p.Stdout()))
		dec.DisallowUnknownFields()
		var r auditReport
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("audit --json printed %q: %v\nstderr %s", p.Stdout(), err, p.Stderr())
		}
		if code != wantCode {
			t.Fatalf("audit exit %d, want %d; report %s %q", code, wantCode, r.counts(), r.Violations)
		}
		if r.Violations == nil || r.Summaries == nil || r.OutboxTotal == nil || r.OutboxSent == nil || r.OutboxUnsent == nil ||
			r.OutboxExhausted == nil || r.DLQ == nil || r.StreamPending == nil {
			t.Fatalf("audit --json lacks a documented field: %s", p.Stdout())
		}
		return r
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// finished plants a job that went through: its summary and its sent email.
	finished := func(jobID string) {
		t.Helper()
		exec(`INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'done')`, jobID)
		exec(`INSERT INTO outbox (topic, dedupe_key, payload, sent_at) VALUES ($1, $2, '{}', now())`,
			summaries.TopicSummaryReady, summaries.DedupeKey(jobID))
	}
	job := func(n int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", n) }

	// A clean pipeline: one job enqueued, processed and acknowledged, its email sent.
	if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: job(1), Tenant: "acme", Payload: json.RawMessage(`{"text":"x"}`)}); err != nil {
		t.Fatal(err)
	}
	readAndAck(t, rdb, keys, true)
	finished(job(1))
	r := audit(0)
	if *r.Summaries != 1 || *r.OutboxTotal != 1 || *r.OutboxSent != 1 || *r.OutboxUnsent != 0 || *r.OutboxExhausted != 0 ||
		*r.DLQ != 0 || *r.StreamPending != 0 || len(r.Violations) != 0 {
		t.Fatalf("clean pipeline: %s %q", r.counts(), r.Violations)
	}
	text := testenv.Start(t, bin, env, "audit")
	if code := text.Wait(20 * time.Second); code != 0 || !strings.Contains(text.Stdout(), "invariants: all hold") {
		t.Fatalf("audit (table) on a clean pipeline: exit %d\n%s", code, text.Stdout())
	}

	plants := []struct {
		name  string
		plant func()
		want  []string // the new violation contains each
		check func(r auditReport) bool
	}{
		{"summary without its outbox row", func() {
			exec(`INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'no email')`, job(2))
		}, []string{"summaries without their email.summary_ready outbox row", job(2)}, func(r auditReport) bool { return *r.Summaries == 2 }},
		{"outbox row without its summary", func() {
			exec(`INSERT INTO outbox (topic, dedupe_key, payload, sent_at) VALUES ($1, $2, '{}', now())`, summaries.TopicSummaryReady, summaries.DedupeKey(job(3)))
		}, []string{"outbox rows without their summary", summaries.DedupeKey(job(3))}, func(r auditReport) bool { return *r.OutboxTotal == 2 }},
		{"job both summarised and dead-lettered", func() {
			finished(job(4))
			if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: job(4), Tenant: "acme", Payload: json.RawMessage(`{"text":"x"}`)}); err != nil {
				t.Fatal(err)
			}
			deadLetter(t, rdb, keys, job(4))
		}, []string{"both summarised and dead-lettered", job(4)}, func(r auditReport) bool { return *r.DLQ == 1 && *r.StreamPending == 0 }},
		{"entry pending for longer than twice ClaimIdle", func() {
			if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: job(5), Tenant: "acme", Payload: json.RawMessage(`{"text":"x"}`)}); err != nil {
				t.Fatal(err)
			}
			readAndAck(t, rdb, keys, false) // a consumer that died holding it
			time.Sleep(3 * claimIdle)
		}, []string{"pending for longer than 2 x ONCEFLOW_CLAIM_IDLE", "consumer ghost"}, func(r auditReport) bool { return *r.StreamPending == 1 }},
		{"unsent row older than the max age", func() {
			exec(`INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'stuck')`, job(6))
			exec(`INSERT INTO outbox (topic, dedupe_key, payload, created_at) VALUES ($1, $2, '{}', now() - interval '1 hour')`,
				summaries.TopicSummaryReady, summaries.DedupeKey(job(6)))
		}, []string{"unsent or exhausted for longer than ONCEFLOW_AUDIT_MAX_AGE", summaries.DedupeKey(job(6)) + " (unsent)"},
			func(r auditReport) bool { return *r.OutboxUnsent == 1 }},
		{"exhausted row older than the max age", func() {
			exec(`INSERT INTO summaries (job_id, tenant, summary) VALUES ($1, 'acme', 'undeliverable')`, job(7))
			exec(`INSERT INTO outbox (topic, dedupe_key, payload, attempts, last_error, exhausted_at) VALUES ($1, $2, '{}', 10, 'webhook answered 400', now() - interval '1 hour')`,
				summaries.TopicSummaryReady, summaries.DedupeKey(job(7)))
		}, []string{summaries.DedupeKey(job(7)) + " (exhausted)"}, func(r auditReport) bool { return *r.OutboxExhausted == 1 }},
	}
	seen := 0
	for i, pl := range plants {
		pl.plant()
		r := audit(4)
		// The last two share a sentence: old unsent and exhausted rows are one invariant.
		wantViolations := i + 1
		if i == len(plants)-1 {
			wantViolations = i
		}
		if len(r.Violations) != wantViolations {
			t.Fatalf("after planting %q: %d violations, want %d: %q", pl.name, len(r.Violations), wantViolations, r.Violations)
		}
		found := false
		for _, v := range r.Violations {
			ok := true
			for _, w := range pl.want {
				ok = ok && strings.Contains(v, w)
			}
			found = found || ok
		}
		if !found {
			t.Fatalf("after planting %q: no violation contains %q: %q", pl.name, pl.want, r.Violations)
		}
		if !pl.check(r) {
			t.Fatalf("after planting %q: counts %s", pl.name, r.counts())
		}
		seen++
	}
	if seen != len(plants) {
		t.Fatal("not every violation was planted")
	}
	text = testenv.Start(t, bin, env, "audit")
	if code := text.Wait(20 * time.Second); code != 4 || strings.Count(text.Stdout(), "VIOLATION:") != len(plants)-1 {
		t.Fatalf("audit (table): exit %d, want 4 and one VIOLATION line per broken invariant\n%s", code, text.Stdout())
	}
}

// readAndAck delivers the next stream entry to the consumer "ghost" and acknowledges it
// when ack is set (a job that went through), or leaves it pending (a consumer that died).
func readAndAck(t *testing.T, rdb *redis.Client, keys queue.Keys, ack bool) {
	t.Helper()
	ctx := context.Background()
	if err := queue.CreateGroup(ctx, rdb, keys, queue.DefaultGroup); err != nil {
		t.Fatal(err)
	}
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: queue.DefaultGroup, Consumer: "ghost",
		Streams: []string{keys.Stream(), ">"}, Count: 1, Block: -1}).Result()
	if err != nil || len(res) != 1 || len(res[0].Messages) != 1 {
		t.Fatalf("read: %v %v", res, err)
	}
	if ack {
		if err := rdb.XAck(ctx, keys.Stream(), queue.DefaultGroup, res[0].Messages[0].ID).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// deadLetter runs a worker whose handler fails permanently until jobID is dead-lettered.
func deadLetter(t *testing.T, rdb *redis.Client, keys queue.Keys, jobID string) {
	t.Helper()
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: rdb, Keys: keys, Consumer: "dead-letterer", Block: 50 * time.Millisecond,
		Logger: testenv.Logger(t),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error {
			return retry.Permanent(errors.New("planted by the audit test"))
		})})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool {
		d, err := queue.FindDead(context.Background(), rdb, keys, jobID)
		return err == nil && len(d) == 1
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
