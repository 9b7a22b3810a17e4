package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/retry"
)

// replaying is a layer that answers every call itself, as the ledger does for a
// recorded call, without calling the provider below it.
type replaying struct{ next llm.Client }

func (r replaying) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	return &llm.Response{ID: "recorded", Content: "recorded answer"}, nil
}

func (r replaying) Stream(context.Context, *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		if yield(llm.Chunk{Content: "recorded answer"}, nil) {
			yield(llm.Chunk{Done: true, FinishReason: llm.FinishStop}, nil)
		}
	}
}

func request(i int) *llm.Request {
	return &llm.Request{Model: "m", IdempotencyKey: fmt.Sprint("job:", i), Messages: []llm.Message{{Role: llm.RoleUser, Content: "hello"}}}
}

// A call the layer answers on its own (a replay) gives its capacity back: it costs
// neither a request of the minute nor a token of the budget.
func TestReplayedCallsGiveTheirCapacityBack(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 2}, TenantTokenBudget: 5000, MaxWait: time.Millisecond})
	provider := fake.New()
	replayed := l.WrapAround(func(next llm.Client) llm.Client { return replaying{next} }, provider)
	ctx := limiter.WithTenant(context.Background(), "acme")
	for i := range 10 {
		if _, err := replayed.Complete(ctx, request(i)); err != nil {
			t.Fatalf("replayed call %d: %v", i, err)
		}
		for range replayed.Stream(ctx, request(100+i)) {
		}
	}
	if provider.Calls() != 0 {
		t.Fatalf("the layer answered, yet the provider had %d calls", provider.Calls())
	}
	direct := l.Wrap(provider)
	for i := range 2 {
		if _, err := direct.Complete(ctx, request(200+i)); err != nil {
			t.Fatalf("after 20 replays, real call %d: %v (the replays kept the minute's requests)", i, err)
		}
	}
	if _, err := direct.Complete(ctx, request(300)); !errors.Is(err, retry.ErrWaiting) {
		t.Fatalf("the third real call of a minute of 2: %v, want a wait", err)
	}
	if u := usageOf(t, l, "acme"); u.BudgetReserved != 0 || u.BudgetUsed == 0 {
		t.Fatalf("budget used %d reserved %d: want the two real calls' usage only, nothing held", u.BudgetUsed, u.BudgetReserved)
	}
}

// rateLimited answers 429 with Retry-After.
type rateLimited struct{ calls int }

func (r *rateLimited) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	r.calls++
	h := http.Header{}
	h.Set("Retry-After", "2")
	return nil, llm.NewAPIError("openai", 429, h, []byte(`{"error":{"type":"requests","code":"rate_limit_exceeded","message":"slow down"}}`), time.Now(), nil)
}

func (r *rateLimited) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		_, err := r.Complete(ctx, req)
		yield(llm.Chunk{}, err)
	}
}

// A 429 is a wait, not a failure: the caller gets a *retry.WaitError wrapping the
// provider's answer, and the next call waits without reaching the provider.
func TestA429IsAWaitForTheCallerAndTheNextCalls(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{MaxWait: time.Millisecond})
	provider := &rateLimited{}
	client := l.Wrap(provider)
	_, err := client.Complete(context.Background(), request(1))
	we := waitErr(t, err)
	var api *llm.APIError
	if !errors.As(err, &api) || api.StatusCode != 429 || we.Delay < 2*time.Second {
		t.Fatalf("got %v (delay %v), want the wait wrapping the 429, for its Retry-After", err, we.Delay)
	}
	for _, call := range []func() error{
		func() error { _, err := client.Complete(context.Background(), request(2)); return err },
		func() error {
			for _, err := range client.Stream(context.Background(), request(3)) {
				return err
			}
			return nil
		},
	} {
		if err := call(); !errors.Is(err, retry.ErrWaiting) || errors.As(err, new(*llm.APIError)) {
			t.Fatalf("a call during the pause: %v, want a wait that never reached the provider", err)
		}
	}
	if provider.calls != 1 {
		t.Fatalf("the provider had %d calls, want the one that answered 429", provider.calls)
	}
}

// A stream is charged its usage when it completes, and its reservation when its
// consumer stops reading (the answer was cut off, billed though unseen).
func TestStreamsAreChargedUsageOrTheirReservation(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{TenantTokenBudget: 100_000})
	client := l.Wrap(fake.New())
	ctx := limiter.WithTenant(context.Background(), "acme")
	var usage *llm.Usage
	for ch, err := range client.Stream(ctx, request(1)) {
		if err != nil {
			t.Fatal(err)
		}
		if ch.Done {
			usage = ch.Usage
		}
	}
	if usage == nil {
		t.Fatal("the fake stream reported no usage")
	}
	want := int64(usage.InputTokens + usage.OutputTokens)
	if u := usageOf(t, l, "acme"); u.BudgetUsed != want || u.BudgetReserved != 0 {
		t.Fatalf("a complete stream: used %d reserved %d, want its usage %d", u.BudgetUsed, u.BudgetReserved, want)
	}
	for range client.Stream(ctx, request(2)) {
		break // the consumer stops at the first chunk
	}
	reservation := int64(llm.EstimateTokens(request(2)))
	if u := usageOf(t, l, "acme"); u.BudgetUsed != want+reservation || u.BudgetReserved != 0 {
		t.Fatalf("a stream cut off: used %d reserved %d, want %d more (its reservation)", u.BudgetUsed, u.BudgetReserved, reservation)
	}
}

// held is a layer that holds the call of one key before passing it on, as the ledger
// holds every call while it writes the call's row: entered closes when that call
// arrives, and it goes on when release closes.
type held struct {
	next             llm.Client
	key              string
	entered, release chan struct{}
}

func (h held) wait(req *llm.Request) {
	if req.IdempotencyKey == h.key {
		close(h.entered)
		<-h.release
	}
}

func (h held) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	h.wait(req)
	return h.next.Complete(ctx, req)
}

func (h held) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		h.wait(req)
		for ch, err := range h.next.Stream(ctx, req) {
			if !yield(ch, err) {
				return
			}
		}
	}
}

// A call admitted before its model was paused, and held by the layer above the
// provider (the ledger writing its row) until after the pause, is put off as an
// admission during the pause is, without reaching the provider: it cannot meet the 429
// the pause stands for.
func TestCallAdmittedBeforeAPauseIsNotSentIntoIt(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprint("stream=", stream), func(t *testing.T) {
			rdb, prefix := testenv.Redis(t)
			// A limit of the minute, far from reached: no first-contact probe, and the
			// admissions go through Redis, as a fleet's do.
			l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 1000}, MaxWait: time.Millisecond})
			provider := &rateLimited{}
			h := held{key: "job:2", entered: make(chan struct{}), release: make(chan struct{})}
			client := l.WrapAround(func(next llm.Client) llm.Client { h.next = next; return h }, provider)
			send := func(i int) error {
				if !stream {
					_, err := client.Complete(context.Background(), request(i))
					return err
				}
				for _, err := range client.Stream(context.Background(), request(i)) {
					if err != nil {
						return err
					}
				}
				return nil
			}
			admitted := make(chan error, 1)
			go func() { admitted <- send(2) }()
			<-h.entered // admitted, held above the provider
			if err := send(1); !errors.As(err, new(*llm.APIError)) {
				t.Fatalf("the first call sent: %v, want the provider's 429", err)
			}
			close(h.release)
			err := <-admitted
			if we := waitErr(t, err); we.Delay < time.Second || errors.As(err, new(*llm.APIError)) {
				t.Fatalf("the call admitted before the pause: %v (delay %v), want a wait for the pause that never reached the provider", err, we.Delay)
			}
			if provider.calls != 1 {
				t.Fatalf("the provider had %d calls, want the one that answered 429", provider.calls)
			}
		})
	}
}

// shortRateLimited answers its first call 429 with retry-after-ms 100, and every call
// after it.
type shortRateLimited struct {
	mu    sync.Mutex
	calls int
}

func (r *shortRateLimited) Complete(context.Context, *llm.Request) (*llm.Response, error) {
	r.mu.Lock()
	r.calls++
	first := r.calls == 1
	r.mu.Unlock()
	if first {
		h := http.Header{}
		h.Set("retry-after-ms", "100")
		return nil, llm.NewAPIError("openai", 429, h, []byte(`{"error":{"type":"requests","code":"rate_limit_exceeded","message":"slow down"}}`), time.Now(), nil)
	}
	return &llm.Response{ID: "answer", Content: "an answer"}, nil
}

func (r *shortRateLimited) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		resp, err := r.Complete(ctx, req)
		if err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		if yield(llm.Chunk{Content: resp.Content}, nil) {
			yield(llm.Chunk{Done: true, FinishReason: llm.FinishStop}, nil)
		}
	}
}

func (r *shortRateLimited) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls
}

// A call admitted before a pause and held above the provider until the pause has
// ended, while the model recovers and its probe is out, waits for the probe like any
// call admitted then: it is put off for a probe's window, not sent beside the probe.
func TestCallAdmittedBeforeAShortPauseWaitsForItsProbe(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 1000}, MaxWait: time.Millisecond})
	provider := &shortRateLimited{}
	h := held{key: "job:2", entered: make(chan struct{}), release: make(chan struct{})}
	client := l.WrapAround(func(next llm.Client) llm.Client { h.next = next; return h }, provider)
	admitted := make(chan error, 1)
	go func() { _, err := client.Complete(context.Background(), request(2)); admitted <- err }()
	<-h.entered
	if _, err := client.Complete(context.Background(), request(1)); !errors.As(err, new(*llm.APIError)) {
		t.Fatalf("the first call: %v, want the provider's 429", err)
	}
	time.Sleep(200 * time.Millisecond) // the 100ms pause has ended; the model recovers
	probe, err := l.Acquire(context.Background(), limiter.CallFor("", request(3)))
	if err != nil {
		t.Fatalf("the probe after the pause: %v", err)
	}
	defer probe.Done(limiter.Result{})
	if _, err := l.Acquire(context.Background(), limiter.CallFor("", request(4))); !errors.Is(err, retry.ErrWaiting) {
		t.Fatalf("an admission while the probe is out: %v, want a wait for its answer", err)
	}
	close(h.release)
	err = <-admitted
	if n := provider.count(); n != 1 || !errors.Is(err, retry.ErrWaiting) {
		t.Fatalf("the call the pause caught above the provider: %v, provider calls %d; want a wait, and only the 429's call at the provider", err, n)
	}
}

// A pause that began and ended before a call's admission does not put the call off:
// only a pause set after it does.
func TestCallAdmittedAfterAPauseEndedIsSent(t *testing.T) {
	rdb, prefix := testenv.Redis(t)
	l := newLimiter(t, rdb, prefix, limiter.Config{Limits: limiter.Limits{RPM: 1000}, MaxWait: 2 * time.Second})
	provider := &shortRateLimited{}
	client := l.WrapAround(func(next llm.Client) llm.Client { return passThrough{next} }, provider)
	if _, err := client.Complete(context.Background(), request(1)); !errors.As(err, new(*llm.APIError)) {
		t.Fatalf("the first call: %v, want the provider's 429", err)
	}
	// The next calls wait in Acquire for the pause and for the probe's answer, then go.
	for i := range 3 {
		if _, err := client.Complete(context.Background(), request(2+i)); err != nil {
			t.Fatalf("call %d after the pause: %v", i, err)
		}
	}
	if n := provider.count(); n != 4 {
		t.Fatalf("the provider had %d calls, want the 429's and the three after it", n)
	}
}

// passThrough is a layer that calls the provider below it for every call.
type passThrough struct{ next llm.Client }

func (p passThrough) Complete(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	return p.next.Complete(ctx, req)
}

func (p passThrough) Stream(ctx context.Context, req *llm.Request) iter.Seq2[llm.Chunk, error] {
	return p.next.Stream(ctx, req)
}
