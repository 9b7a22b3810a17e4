package openai_test

// The retry scenarios, through the real SDK over HTTP against fake-llm, with
// request counts read from /stats.

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// complete runs one retried Complete with a manual clock (sleeps are recorded, never
// slept) and returns what OnRetry saw.
func complete(c llm.Client, p retry.Policy, clock *retrytest.Clock, budget time.Duration) (*llm.Response, []retry.Retry, error) {
	var retries []retry.Retry
	p.Clock = clock
	p.OnRetry = func(r retry.Retry) { retries = append(retries, r) }
	resp, err := retry.Do(context.Background(), p, retry.AfterOn(clock, budget), func(ctx context.Context) (*llm.Response, error) {
		return c.Complete(ctx, summarise("job-1"))
	})
	return resp, retries, err
}

func Test429IsRetriedAndTheSecondRequestSucceeds(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault429})
	resp, retries, err := complete(c, retry.Policy{}, retrytest.NewClock(t0), time.Minute)
	if err != nil || resp.Content == "" {
		t.Fatalf("Do: %v", err)
	}
	if len(retries) != 1 || retries[0].Class != retry.ClassRateLimited {
		t.Fatalf("retries %+v, want one rate_limited", retries)
	}
	var apiErr *llm.APIError
	if !errors.As(retries[0].Err, &apiErr) || apiErr.StatusCode != 429 || apiErr.Code != "rate_limit_exceeded" || apiErr.RequestID == "" {
		t.Fatalf("the 429 was not mapped to an APIError: %#v", retries[0].Err)
	}
	if st := stats(t, base); st.Requests != 2 || st.ByStatus["429"] != 1 || st.ByStatus["200"] != 1 || st.ByIdempotencyKey["job-1"] != 2 {
		t.Fatalf("stats %+v, want 2 requests (429 then 200) with the same key", st)
	}
}

func TestContextTooLongReachesTheServerOnce(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{MaxInputChars: 40})
	clock := retrytest.NewClock(t0)
	_, retries, err := complete(c, retry.Policy{}, clock, time.Minute)
	var apiErr *llm.APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Code != "context_length_exceeded" {
		t.Fatalf("err %v, want the 400 context_length_exceeded", err)
	}
	if v := retry.Classify(err); v.Retryable || v.Class != retry.ClassClientError || retry.Transient(err) {
		t.Fatalf("verdict %+v: a 400 must be permanent and dead-lettered", v)
	}
	if st := stats(t, base); st.Requests != 1 || len(retries) != 0 || len(clock.Sleeps()) != 0 {
		t.Fatalf("stats %+v, %d retries: want exactly one request", st, len(retries))
	}
}

func TestRetryAfterIsHonoured(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		header http.Header
		cap    time.Duration
		check  func(d time.Duration) bool
		want   string
	}{
		{"delta-seconds", http.Header{"Retry-After": {"3"}}, 0, func(d time.Duration) bool { return d == 3*time.Second }, "3s"},
		{"retry-after-ms wins", http.Header{"Retry-After": {"3"}, "Retry-After-Ms": {"1500"}}, 0, func(d time.Duration) bool { return d == 1500*time.Millisecond }, "1.5s"},
		{"HTTP-date", http.Header{"Retry-After": {time.Now().Add(6 * time.Second).UTC().Format(http.TimeFormat)}}, 0,
			func(d time.Duration) bool { return d > 4*time.Second && d <= 6*time.Second }, "about 5s (second resolution)"},
		{"capped", http.Header{"Retry-After": {"120"}}, 10 * time.Second, func(d time.Duration) bool { return d == 10*time.Second }, "the 10s cap"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, base, c := fakeLLM(t, fakeserver.Config{})
			s.Script(fakeserver.Fault{Kind: fakeserver.Fault429, Header: tc.header})
			clock := retrytest.NewClock(t0)
			_, retries, err := complete(c, retry.Policy{RetryAfterCap: tc.cap}, clock, 10*time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			sleeps := clock.Sleeps()
			if len(sleeps) != 1 || !tc.check(sleeps[0]) || !retries[0].FromRetryAfter || retries[0].Delay != sleeps[0] {
				t.Fatalf("slept %v (retries %+v), want %s from Retry-After", sleeps, retries, tc.want)
			}
			if st := stats(t, base); st.Requests != 2 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// A model that always hangs, per-call timeout 0.2s and deadline 0.5s (the minimum
// useful attempt lowered to 0.1s) gives up within the deadline plus one per-call
// timeout after at most three calls. The per-call timeout is a real context deadline;
// the clock skips the backoff sleeps but counts them, so the elapsed time it reports
// is real work plus simulated waiting, compared as a ratio.
func TestAlwaysHangingModelGivesUpWithinTheDeadline(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{Hang: 1})
	const perCall, budget = 200 * time.Millisecond, 500 * time.Millisecond
	clock := retrytest.NewSkipClock()
	p := retry.Policy{PerCallTimeout: perCall, MinAttempt: 100 * time.Millisecond, Base: 50 * time.Millisecond, Clock: clock}
	_, err := retry.Do(context.Background(), p, retry.AfterOn(clock, budget), func(ctx context.Context) (*llm.Response, error) {
		return c.Complete(ctx, summarise(""))
	})
	elapsed := clock.Elapsed()
	if !errors.Is(err, retry.ErrDeadlineExceeded) {
		t.Fatalf("err %v, want the delivery deadline", err)
	}
	var at *retry.AttemptTimeoutError
	if !errors.As(err, &at) {
		t.Fatalf("err %v does not carry the last attempt's timeout", err)
	}
	st := stats(t, base)
	if st.Requests < 1 || st.Requests > 3 || st.ByFault["hang"] != st.Requests {
		t.Fatalf("stats %+v, want 1 to 3 hung calls", st)
	}
	if ratio := float64(elapsed) / float64(budget+perCall); ratio > 1 {
		t.Fatalf("gave up after %v: %.2f of deadline+per-call (%v), want at most 1", elapsed, ratio, budget+perCall)
	}
}

// A server that sends one byte every 50ms keeps the connection busy (a per-read
// timeout would never fire), yet the per-call context deadline cuts the call, for a
// plain answer (the SDK reads the body under the context) and for a stream.
func TestDripIsCutByTheWallClockTimeout(t *testing.T) {
	t.Parallel()
	const interval, perCall = 50 * time.Millisecond, 500 * time.Millisecond
	for _, stream := range []bool{false, true} {
		s, base, c := fakeLLM(t, fakeserver.Config{DripInterval: interval})
		undripped, err := c.Complete(context.Background(), summarise(""))
		if err != nil {
			t.Fatal(err)
		}
		fullDrip := time.Duration(len(undripped.Raw)) * interval // about 20s
		s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrip})
		start := time.Now()
		_, err = retry.Do(context.Background(), retry.Policy{PerCallTimeout: perCall, MaxAttempts: 1}, retry.After(time.Minute),
			func(ctx context.Context) (*llm.Response, error) {
				if stream {
					return llm.Collect(c.Stream(ctx, summarise("")))
				}
				return c.Complete(ctx, summarise(""))
			})
		took := time.Since(start)
		var at *retry.AttemptTimeoutError
		if !errors.As(err, &at) || retry.Classify(err).Class != retry.ClassTimeout {
			t.Fatalf("stream=%t: err %v, want the per-call timeout", stream, err)
		}
		st := stats(t, base)
		if st.ByFault["drip"] != 1 || st.DrippedBytes < 3 {
			t.Fatalf("stream=%t: stats %+v: bytes were not arriving", stream, st)
		}
		if took > fullDrip/4 {
			t.Fatalf("stream=%t: the call lasted %v, a quarter of the %v the drip would take: not cut by the per-call timeout", stream, took, fullDrip)
		}
	}
}

func TestQuota429IsNotRetried(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultQuota})
	_, retries, err := complete(c, retry.Policy{}, retrytest.NewClock(t0), time.Minute)
	var apiErr *llm.APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 || apiErr.Code != "insufficient_quota" {
		t.Fatalf("err %v", err)
	}
	if v := retry.Classify(err); v.Retryable || v.Class != retry.ClassQuota {
		t.Fatalf("verdict %+v", v)
	}
	if st := stats(t, base); st.Requests != 1 || len(retries) != 0 {
		t.Fatalf("stats %+v, retries %d: a quota 429 must reach the server once", st, len(retries))
	}
}

func TestUnknownErrorIsNotRetried(t *testing.T) {
	t.Parallel()
	// A 200 whose body is not a chat completion: no retry can fix it.
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultMalformed})
	_, _, err := complete(c, retry.Policy{}, retrytest.NewClock(t0), time.Minute)
	if !errors.Is(err, llm.ErrMalformedResponse) || retry.Retryable(err) || retry.Transient(err) {
		t.Fatalf("err %v, want a permanent malformed-response error", err)
	}
	if st := stats(t, base); st.Requests != 1 {
		t.Fatalf("stats %+v", st)
	}
	// And an error the classifier has never seen, raised by our own code.
	calls := 0
	_, err = retry.Do(context.Background(), retry.Policy{Clock: retrytest.NewClock(t0)}, retry.After(time.Minute), func(ctx context.Context) (*llm.Response, error) {
		calls++
		resp, err := c.Complete(ctx, summarise(""))
		if err != nil {
			return nil, err
		}
		if len(resp.Content) > 0 {
			return nil, errors.New("our own parser choked on the summary")
		}
		return resp, nil
	})
	if calls != 1 || retry.Classify(err).Class != retry.ClassUnknown {
		t.Fatalf("%d calls, err %v: an unknown error must not be retried", calls, err)
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func Test503StormUsesExactlyMaxAttempts(t *testing.T) {
	t.Parallel()
	_, base, c := fakeLLM(t, fakeserver.Config{Fail503: 1})
	clock := retrytest.NewClock(t0)
	_, retries, err := complete(c, retry.Policy{MaxAttempts: 4}, clock, 10*time.Minute)
	var ex *retry.ExhaustedError
	if !errors.As(err, &ex) || ex.Attempts != 4 || !retry.Transient(err) {
		t.Fatalf("err %v, want ExhaustedError after 4 attempts (transient, so the queue redelivers)", err)
	}
	if st := stats(t, base); st.Requests != 4 || st.ByStatus["503"] != 4 {
		t.Fatalf("stats %+v, want exactly 4 requests", st)
	}
	if len(retries) != 3 || len(clock.Sleeps()) != 3 {
		t.Fatalf("%d retries, sleeps %v", len(retries), clock.Sleeps())
	}
	for i, d := range clock.Sleeps() {
		if upper := 500 * time.Millisecond << i; d < 0 || d > upper {
			t.Fatalf("sleep %d = %v outside full jitter [0, %v]", i, d, upper)
		}
	}
}

func TestShouldRetryHeaderWins(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.Fault503, Header: http.Header{"X-Should-Retry": {"false"}}})
	_, _, err := complete(c, retry.Policy{}, retrytest.NewClock(t0), time.Minute)
	if err == nil || retry.Retryable(err) {
		t.Fatalf("err %v: x-should-retry: false must stop a 503", err)
	}
	if st := stats(t, base); st.Requests != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestDroppedStreamIsRetried(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultDrop})
	var retries []retry.Retry
	p := retry.Policy{Clock: retrytest.NewClock(t0), OnRetry: func(r retry.Retry) { retries = append(retries, r) }}
	resp, err := retry.Do(context.Background(), p, retry.After(time.Minute), func(ctx context.Context) (*llm.Response, error) {
		return llm.Collect(c.Stream(ctx, summarise("job-drop")))
	})
	if err != nil || resp.FinishReason != llm.FinishStop {
		t.Fatalf("Do: %+v %v", resp, err)
	}
	if len(retries) != 1 || retries[0].Class != retry.ClassConnection {
		t.Fatalf("retries %+v, want one connection retry for the dropped stream", retries)
	}
	if st := stats(t, base); st.Requests != 2 || st.ByFault["drop_stream"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestSDKRetriesAreOff(t *testing.T) {
	t.Parallel()
	// Without package retry, one call is one request, whatever the answer.
	_, base, c := fakeLLM(t, fakeserver.Config{Fail503: 1})
	if _, err := c.Complete(context.Background(), summarise("")); err == nil {
		t.Fatal("a 503 succeeded")
	}
	for range c.Stream(context.Background(), summarise("")) {
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v: the SDK retried on its own", st)
	}
}

func TestErrorEventMidStreamIsAnAPIErrorAndRetried(t *testing.T) {
	t.Parallel()
	s, base, c := fakeLLM(t, fakeserver.Config{})
	s.Script(fakeserver.Fault{Kind: fakeserver.FaultStreamError})
	var retries []retry.Retry
	p := retry.Policy{Clock: retrytest.NewClock(t0), OnRetry: func(r retry.Retry) { retries = append(retries, r) }}
	resp, err := retry.Do(context.Background(), p, retry.After(time.Minute), func(ctx context.Context) (*llm.Response, error) {
		return llm.Collect(c.Stream(ctx, summarise("")))
	})
	if err != nil || resp.FinishReason != llm.FinishStop {
		t.Fatalf("Do: %+v %v", resp, err)
	}
	var apiErr *llm.APIError
	if len(retries) != 1 || !errors.As(retries[0].Err, &apiErr) || apiErr.Type != "server_error" || apiErr.StatusCode != 200 || retries[0].Class != retry.ClassServerError {
		t.Fatalf("retries %+v", retries)
	}
	if st := stats(t, base); st.Requests != 2 {
		t.Fatalf("stats %+v", st)
	}
}
