package ledger_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/retry"
	"github.com/onceflow/onceflow/retry/retrytest"
)

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
