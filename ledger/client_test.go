package ledger_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

func quickRetry() retry.Policy {
	return retry.Policy{MaxAttempts: 4, PerCallTimeout: 500 * time.Millisecond, MinAttempt: 50 * time.Millisecond,
		Base: time.Millisecond, Cap: 5 * time.Millisecond, Clock: retrytest.NewSkipClock()}
}

func TestClientRecordsAnAmbiguousTimeoutAndReplaysTheAnswer(t *testing.T) {
	t.Parallel()
	srv, adapter := fakeLLM(t, fakeserver.Config{})
	srv.Script(fakeserver.Fault{Kind: fakeserver.FaultHang}) // the first attempt never gets an answer
	reg := prometheus.NewRegistry()
	l, _ := newLedger(t, ledger.Config{Registerer: reg})
	client := l.Wrap("openai", adapter)
	ctx := ctxT(t)
	req := request("Summarise for the account team:\n\nthe quarterly numbers")
	req.IdempotencyKey = ledger.Work("job-7", "summarise")
	key := ledger.Key(req.IdempotencyKey, req)

	resp, err := retry.Do(ctx, quickRetry(), retry.After(10*time.Second), func(ctx context.Context) (*llm.Response, error) {
		return client.Complete(ctx, req)
	})
	if err != nil {
		t.Fatal(err)
	}
	st := srv.Stats()
	if st.Requests != 2 || st.ByIdempotencyKey[key] != 2 {
		t.Fatalf("fake-llm saw %d requests, by key %v; want 2 under the ledger key", st.Requests, st.ByIdempotencyKey)
	}
	row := mustGet(t, l, key)
	if row.State != ledger.StateSucceeded || row.Attempt != 2 || row.Ambiguous != 1 || string(row.Raw) != string(resp.Raw) {
		t.Fatalf("row %+v", row)
	}
	if v := counterValue(t, reg, "onceflow_llm_ledger_ambiguous_total", map[string]string{"provider": "openai", "model": "gpt-4.1-mini"}); v != 1 {
		t.Errorf("ambiguous_total %v", v)
	}

	// A redelivery: the recorded answer, byte for byte, and no request.
	again, err := client.Complete(ctx, req)
	if err != nil || again.ID != resp.ID || again.Content != resp.Content || string(again.Raw) != string(resp.Raw) {
		t.Fatalf("replay %+v %v", again, err)
	}
	if n := srv.Stats().Requests; n != 2 {
		t.Fatalf("the replay made a request (%d in all)", n)
	}
}

func TestClientRecordsAClearFailure(t *testing.T) {
	t.Parallel()
	srv, adapter := fakeLLM(t, fakeserver.Config{RetryAfter: time.Millisecond})
	srv.Script(fakeserver.Fault{Kind: fakeserver.Fault429})
	l, _ := newLedger(t, ledger.Config{})
	client := l.Wrap("openai", adapter)
	ctx := llm.WithTenant(ctxT(t), "acme") // a job's tenant: recorded on the row
	req := request("x")
	req.IdempotencyKey = "job-8"
	if _, err := client.Complete(ctx, req); err == nil {
		t.Fatal("no error for a 429")
	}
	row := mustGet(t, l, ledger.Key("job-8", req))
	if row.State != ledger.StateFailed || row.Ambiguous != 0 || !strings.Contains(row.Error, "429") {
		t.Fatalf("row after a 429: %+v", row)
	}
	if _, err := client.Complete(ctx, req); err != nil {
		t.Fatal(err)
	}
	if row := mustGet(t, l, ledger.Key("job-8", req)); row.State != ledger.StateSucceeded || row.Attempt != 2 || row.Ambiguous != 0 {
		t.Fatalf("row %+v", row)
	}
	if rows, err := l.List(ctx, ledger.ListOptions{Tenant: "acme"}); err != nil || len(rows) != 1 || rows[0].Key != ledger.Key("job-8", req) {
		t.Fatalf("the tenant's rows: %+v %v", rows, err)
	}
	if _, err := client.Complete(ctx, &llm.Request{Messages: req.Messages}); !errors.Is(err, ledger.ErrNoWork) || !retry.IsPermanent(err) {
		t.Fatalf("no IdempotencyKey: %v", err)
	}
}

// streamTask is the user-visible task of the stream tests: stream an answer through
// the ledger, and only when it is complete commit its output (the downstream effect)
// in a table, once.
func streamTask(ctx context.Context, t *testing.T, client llm.Client, l *ledger.Ledger, db ledger.DB, req *llm.Request, maxAttempts int) (attempts int, partials []string, firstIDs []string) {
	t.Helper()
	key := ledger.Key(req.IdempotencyKey, req)
	for attempts = 1; attempts <= maxAttempts; attempts++ {
		var content strings.Builder
		var id string
		var failed error
		for ch, err := range client.Stream(ctx, req) {
			if err != nil {
				failed = err
				break
			}
			if ch.ID != "" {
				id = ch.ID
			}
			content.WriteString(ch.Content)
			if ch.Done {
				// Completion, not the start, commits the effect.
				if _, err := db.Exec(ctx, `INSERT INTO outputs (task, response_id, body) VALUES ($1, $2, $3) ON CONFLICT (task) DO NOTHING`,
					req.IdempotencyKey, id, content.String()); err != nil {
					t.Fatal(err)
				}
			}
		}
		if failed == nil {
			return attempts, partials, firstIDs
		}
		if !retry.Transient(failed) {
			t.Fatalf("attempt %d: permanent stream error %v", attempts, failed)
		}
		// The retry can see what already exists: the dropped attempt's partial output.
		row := mustGet(t, l, key)
		if row.State != ledger.StateInFlight || row.Owner != "" {
			t.Fatalf("after a dropped stream the row is %s owned by %q", row.State, row.Owner)
		}
		if row.Partial != content.String() {
			t.Fatalf("persisted partial %q, streamed %q", row.Partial, content.String())
		}
		partials = append(partials, row.Partial)
		firstIDs = append(firstIDs, id)
	}
	t.Fatalf("no complete stream in %d attempts", maxAttempts)
	return
}

func outputsTable(t *testing.T, db ledger.DB) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `CREATE TABLE outputs (task text PRIMARY KEY, response_id text, body text)`); err != nil {
		t.Fatal(err)
	}
}

func TestDroppedStreamLeavesNothingHalfDoneAndTheRetryMakesANewGeneration(t *testing.T) {
	t.Parallel()
	srv, adapter := fakeLLM(t, fakeserver.Config{})
	srv.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop}) // the first stream closes halfway
	l, pool := newLedger(t, ledger.Config{StreamFlushBytes: 16})
	outputsTable(t, pool)
	client := l.Wrap("openai", adapter)
	ctx := ctxT(t)
	req := request("Summarise for the account team:\n\n" + strings.Repeat("revenue grew in every region this quarter ", 20))
	req.Temperature = llm.Float(1) // each generation differs
	req.IdempotencyKey = ledger.Work("task-1", "answer")

	attempts, partials, firstIDs := streamTask(ctx, t, client, l, pool, req, 3)
	if attempts != 2 || len(partials) != 1 || partials[0] == "" {
		t.Fatalf("%d attempts, partials %q: want the second to complete after the first left a partial", attempts, partials)
	}
	var n int
	var responseID, body string
	if err := pool.QueryRow(ctx, `SELECT count(*), max(response_id), max(body) FROM outputs`).Scan(&n, &responseID, &body); err != nil {
		t.Fatal(err)
	}
	row := mustGet(t, l, ledger.Key(req.IdempotencyKey, req))
	rec, _ := (&ledger.Record{Response: row.Response}).LLMResponse()
	if n != 1 || row.State != ledger.StateSucceeded || rec.Content != body || rec.ID != responseID {
		t.Fatalf("%d outputs (%q, %q); row %s with %q %q", n, responseID, body, row.State, rec.ID, rec.Content)
	}
	if responseID == firstIDs[0] {
		t.Fatalf("the retry reused the dropped generation %s: streams cannot resume, it must be new", responseID)
	}
	if row.Attempt != 2 || row.Ambiguous != 1 || row.Partial != "" {
		t.Fatalf("row attempt %d ambiguous %d partial %q", row.Attempt, row.Ambiguous, row.Partial)
	}
	if st := srv.Stats(); st.Requests != 2 {
		t.Fatalf("%d requests", st.Requests)
	}
	// The finished task replays: no third generation, the same single output.
	if a, _, _ := streamTask(ctx, t, client, l, pool, req, 1); a != 1 || srv.Stats().Requests != 2 {
		t.Fatalf("replay: %d attempts, %d requests", a, srv.Stats().Requests)
	}
}

// With fake-llm's --drop-stream probability (Config.DropStream), whatever the number of
// drops, the task ends with exactly one output and one ambiguous attempt per drop.
func TestDropStreamFlagGivesExactlyOneFinalOutput(t *testing.T) {
	t.Parallel()
	srv, adapter := fakeLLM(t, fakeserver.Config{DropStream: 0.6, Seed: 7})
	l, pool := newLedger(t, ledger.Config{StreamFlushBytes: 32})
	outputsTable(t, pool)
	client := l.Wrap("openai", adapter)
	ctx := ctxT(t)
	tasks := 0
	for i := range 6 {
		req := request(fmt.Sprintf("Summarise for the account team:\n\nreport %d: %s", i, strings.Repeat("numbers went up and to the right ", 10)))
		req.IdempotencyKey = ledger.Work(fmt.Sprintf("task-%d", i), "answer")
		attempts, partials, _ := streamTask(ctx, t, client, l, pool, req, 30)
		row := mustGet(t, l, ledger.Key(req.IdempotencyKey, req))
		if row.Ambiguous != attempts-1 || len(partials) != attempts-1 {
			t.Fatalf("task %d: %d attempts, %d ambiguous, %d partials", i, attempts, row.Ambiguous, len(partials))
		}
		tasks++
	}
	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM outputs`).Scan(&n)
	st := srv.Stats()
	if n != tasks || st.ByFault["drop_stream"] == 0 || st.Requests != int64(tasks)+st.ByFault["drop_stream"] {
		t.Fatalf("%d outputs for %d tasks; %d requests, %d drops", n, tasks, st.Requests, st.ByFault["drop_stream"])
	}
}

// chunkModel streams n chunks of size bytes (failing after failAt chunks when failAt >
// 0), advancing clock by step per chunk: a provider stand-in to count the ledger's
// writes exactly.
type chunkModel struct {
	n, size, failAt int
	clock           *retrytest.Clock
	step            time.Duration
}

func (m *chunkModel) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	return nil, errors.New("not used")
}

func (m *chunkModel) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		for i := range m.n {
			if m.failAt > 0 && i == m.failAt {
				yield(llm.Chunk{}, fmt.Errorf("stream cut: %w", io.ErrUnexpectedEOF))
				return
			}
			if m.clock != nil {
				m.clock.Advance(m.step)
			}
			if !yield(llm.Chunk{Content: strings.Repeat(string(rune('a'+i%26)), m.size), ID: "gen-1"}, nil) {
				return
			}
		}
		yield(llm.Chunk{Done: true, ID: "gen-1", FinishReason: "stop"}, nil)
	}
}

func collect(t *testing.T, seq iter.Seq2[llm.Chunk, error]) (string, error) {
	t.Helper()
	var b strings.Builder
	for ch, err := range seq {
		if err != nil {
			return b.String(), err
		}
		b.WriteString(ch.Content)
	}
	return b.String(), nil
}

func TestStreamPartialWritesAreBatched(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	var rt roundtrip.Counter
	// One connection, warmed up below, so that statement preparation is not counted.
	pool, err := connect.Postgres(context.Background(), dsn+"&pool_max_conns=1", &rt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := ctxT(t)
	warm, _ := ledger.New(pool, ledger.Config{StreamFlushBytes: 1, Logger: testenv.Logger(t)})
	for _, fail := range []int{0, 2} {
		req := request("warm-up")
		req.IdempotencyKey = fmt.Sprint("warm-up", fail)
		_, _ = collect(t, warm.Wrap("openai", &chunkModel{n: 3, size: 1, failAt: fail}).Stream(ctx, req))
		_, _ = collect(t, warm.Wrap("openai", &chunkModel{n: 3, size: 1}).Stream(ctx, req))
	}

	t.Run("by size", func(t *testing.T) {
		l, _ := ledger.New(pool, ledger.Config{StreamFlushBytes: 1000, StreamFlushInterval: time.Hour, Logger: testenv.Logger(t)})
		req := request("size")
		req.IdempotencyKey = "by-size"
		rt.Reset()
		text, err := collect(t, l.Wrap("openai", &chunkModel{n: 400, size: 10}).Stream(ctx, req))
		if err != nil || len(text) != 4000 {
			t.Fatal(len(text), err)
		}
		// 400 chunks: 1 insert, 3 partial writes (when 1000 bytes, then half of what was
		// written, are buffered: at 1000, 2000 and 3000; the last 1000 bytes wait for
		// 1500), 1 success.
		if got := rt.Postgres(); got != 5 {
			t.Fatalf("%d PostgreSQL round trips for a 400-chunk stream, want 5", got)
		}
		row := mustGet(t, l, ledger.Key(req.IdempotencyKey, req))
		rec, _ := (&ledger.Record{Response: row.Response}).LLMResponse()
		if row.State != ledger.StateSucceeded || rec.Content != text {
			t.Fatalf("row %s, content %d bytes", row.State, len(rec.Content))
		}
	})

	t.Run("by interval", func(t *testing.T) {
		clock := retrytest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		l, _ := ledger.New(pool, ledger.Config{StreamFlushBytes: 1 << 20, StreamFlushInterval: time.Second, Clock: clock, Logger: testenv.Logger(t)})
		req := request("interval")
		req.IdempotencyKey = "by-interval"
		rt.Reset()
		// 100 chunks 250ms apart: a write every 4 chunks.
		if _, err := collect(t, l.Wrap("openai", &chunkModel{n: 100, size: 3, clock: clock, step: 250 * time.Millisecond}).Stream(ctx, req)); err != nil {
			t.Fatal(err)
		}
		if got := rt.Postgres(); got != 2+25 {
			t.Fatalf("%d round trips, want 2 + 100/4", got)
		}
	})

	t.Run("cut stream keeps what arrived", func(t *testing.T) {
		l, _ := ledger.New(pool, ledger.Config{StreamFlushBytes: 1000, StreamFlushInterval: time.Hour, Logger: testenv.Logger(t)})
		req := request("cut")
		req.IdempotencyKey = "cut"
		text, err := collect(t, l.Wrap("openai", &chunkModel{n: 400, size: 10, failAt: 250}).Stream(ctx, req))
		if !errors.Is(err, io.ErrUnexpectedEOF) || len(text) != 2500 {
			t.Fatalf("%d bytes, %v", len(text), err)
		}
		row := mustGet(t, l, ledger.Key(req.IdempotencyKey, req))
		if row.State != ledger.StateInFlight || row.Partial != text || row.PartialAttempt != 1 || row.Ambiguous != 1 {
			t.Fatalf("row %s, partial %d bytes of attempt %d, ambiguous %d", row.State, len(row.Partial), row.PartialAttempt, row.Ambiguous)
		}
		// The next attempt sees it, and its own first batch replaces it.
		att, _, err := l.Begin(ctx, ledger.Call{Key: row.Key, RequestHash: row.RequestHash, Provider: "openai"})
		if err != nil {
			t.Fatal(err)
		}
		if prev, n := att.PreviousPartial(); prev != text || n != 1 || att.Number() != 2 {
			t.Fatalf("previous partial %d bytes of attempt %d; this is attempt %d", len(prev), n, att.Number())
		}
		if ok, err := att.AppendPartial(ctx, "new generation"); !ok || err != nil {
			t.Fatal(ok, err)
		}
		if row := mustGet(t, l, row.Key); row.Partial != "new generation" || row.PartialAttempt != 2 {
			t.Fatalf("partial %q of attempt %d", row.Partial, row.PartialAttempt)
		}
		_ = att.Fail(ctx, errors.New("done"), false)
	})

	t.Run("replay", func(t *testing.T) {
		l, _ := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
		req := request("replay")
		req.IdempotencyKey = "replay"
		model := &chunkModel{n: 5, size: 4}
		first, err := collect(t, l.Wrap("openai", model).Stream(ctx, req))
		if err != nil {
			t.Fatal(err)
		}
		var done llm.Chunk
		var text strings.Builder
		for ch, err := range l.Wrap("openai", &chunkModel{failAt: 1, n: 5, size: 1}).Stream(ctx, req) {
			if err != nil {
				t.Fatalf("replay called the model: %v", err)
			}
			text.WriteString(ch.Content)
			if ch.Done {
				done = ch
			}
		}
		if text.String() != first || done.FinishReason != "stop" || done.ID != "gen-1" {
			t.Fatalf("replayed %q (%+v), want %q", text.String(), done, first)
		}
	})
}

// TestAmbiguousFailureAccounting runs 400 jobs' model calls through the ledger against a
// fake-llm that hangs (2%), drops the connection halfway through the answer (3%) and
// answers 503 (5%), and checks that the ledger's ambiguous count is exactly the number
// of hangs and drops (the attempts the provider may have billed without the answer
// reaching us), that 503s count as clear failures, and that every job ends with one
// recorded answer. The figure it logs is the one docs/providers.md quotes: what a
// provider without server-side keys costs at these failure rates.
func TestAmbiguousFailureAccounting(t *testing.T) {
	t.Parallel()
	srv, adapter := fakeLLM(t, fakeserver.Config{Hang: 0.02, DropStream: 0.03, Fail503: 0.05, Seed: 42})
	l, pool := newLedger(t, ledger.Config{})
	client := l.Wrap("openai", adapter)
	ctx := ctxT(t)
	const jobs = 400
	// A per-call timeout far above a fake call (ms) but for its hangs: under a loaded
	// machine (make test runs packages side by side, -race) a shorter one timed out
	// ordinary calls, which the ledger rightly counts as ambiguous.
	pol := retry.Policy{MaxAttempts: 10, PerCallTimeout: 2 * time.Second, MinAttempt: 50 * time.Millisecond,
		Base: time.Millisecond, Cap: 2 * time.Millisecond, Clock: retrytest.NewSkipClock()}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	errs := make(chan error, jobs)
	for i := range jobs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			req := request(fmt.Sprintf("Summarise for the account team:\n\nreport %d", i))
			req.IdempotencyKey = ledger.Work(fmt.Sprintf("job-%d", i), "summarise")
			if _, err := retry.Do(ctx, pol, retry.After(time.Minute), func(ctx context.Context) (*llm.Response, error) {
				return client.Complete(ctx, req)
			}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	st, err := ledger.ReadStats(ctx, pool)
	if err != nil || len(st) != 1 {
		t.Fatal(st, err)
	}
	s := st[0]
	faults := srv.Stats().ByFault
	ambiguousFaults := faults["hang"] + faults["drop_stream"]
	if s.Calls != jobs || s.Succeeded != jobs || s.Ambiguous != ambiguousFaults || faults["fail_503"] == 0 || ambiguousFaults == 0 {
		t.Fatalf("ledger %+v; injected %v", s, faults)
	}
	requests := srv.Stats().Requests
	if s.Attempts != requests {
		t.Fatalf("attempts %d, requests %d", s.Attempts, requests)
	}
	t.Logf("%d jobs, %d requests: %d ambiguous attempts (%d hangs, %d drops) = %.1f%% of jobs billed an extra generation; %d clear 503s (not billed)",
		jobs, requests, s.Ambiguous, faults["hang"], faults["drop_stream"], 100*float64(s.Ambiguous)/jobs, faults["fail_503"])
}

// Client stores each call's request on its row, as JSON without the idempotency key,
// for offline evaluation, with Config.KeepRequests; without, it stores none.
func TestClientStoresTheRequestWhenKept(t *testing.T) {
	t.Parallel()
	for _, omit := range []bool{false, true} {
		_, adapter := fakeLLM(t, fakeserver.Config{})
		l, db := newLedger(t, ledger.Config{KeepRequests: !omit})
		req := request("Summarise: the numbers")
		req.IdempotencyKey = ledger.Work(fmt.Sprint("job-req-", omit), "summarise")
		key := ledger.Key(req.IdempotencyKey, req)
		if _, err := l.Wrap("openai", adapter).Complete(ctxT(t), req); err != nil {
			t.Fatal(err)
		}
		var stored []byte
		if err := db.QueryRow(ctxT(t), `SELECT request FROM llm_calls WHERE idem_key = $1`, key).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		if omit {
			if stored != nil {
				t.Fatalf("without KeepRequests the row holds a request %s", stored)
			}
			continue
		}
		var got llm.Request
		if err := json.Unmarshal(stored, &got); err != nil || got.IdempotencyKey != "" || ledger.RequestHash(&got) != ledger.RequestHash(req) {
			t.Fatalf("stored request %s (%v): want the request, whose hash is the row's", stored, err)
		}
	}
}

// nulModel answers every request with a text holding U+0000.
type nulModel struct{ llm.Client }

func (nulModel) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	return &llm.Response{Model: "gpt-4.1-mini", Content: "a\x00b", FinishReason: llm.FinishStop}, nil
}

// An answer holding U+0000 is recorded with U+FFFD in its place (jsonb holds none), and
// the call that made it returns what a replay returns: every delivery acts on the same
// answer.
func TestClientReturnsTheAnswerAsRecordedWhenItHoldsNUL(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{})
	client := l.Wrap("openai", nulModel{})
	req := request("anything")
	req.IdempotencyKey = ledger.Work("job-nul", "summarise")
	first, err := client.Complete(ctxT(t), req)
	if err != nil {
		t.Fatal(err)
	}
	replay, err := client.Complete(ctxT(t), req)
	if err != nil {
		t.Fatal(err)
	}
	if first.Content != "a\uFFFDb" || replay.Content != first.Content {
		t.Fatalf("first %q, replay %q; want both %q", first.Content, replay.Content, "a\uFFFDb")
	}
}
