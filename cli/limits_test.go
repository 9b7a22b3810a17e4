package cli

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// One 429 pauses every process: two real `onceflow work` processes (4 jobs each at a
// time) share a provider that, once both have made calls, answers one request 429 with
// Retry-After 3 and refuses every request for those 3 seconds, as a provider's limiter
// does. With the limiter on, that one 429 stops both processes: at most a request or
// two sent in the millisecond before the pause was announced meet it. Off, each of the
// 8 slots meets a 429 of its own (each then honours its Retry-After). Either way every
// job is summarised once and nothing is dead-lettered.
func TestOne429PausesEveryWorkProcess(t *testing.T) {
	t.Parallel()
	testenv.Binary(t) // built before the clocks start
	for _, admission := range []string{"on", "off"} {
		t.Run("admission="+admission, func(t *testing.T) {
			t.Parallel()
			inPause := pausedFleet(t, admission)
			if admission == "off" && inPause <= 2 {
				// The control on a loaded machine may have had its slots between jobs when
				// the pause began: once more before calling the test blind.
				t.Logf("without the limiter only %d more requests met the pause; running the control again", inPause)
				inPause = pausedFleet(t, admission)
			}
			switch {
			case admission == "on" && inPause > 2:
				t.Fatalf("with the limiter, %d more requests met the pause one 429 announced, want at most 2", inPause)
			case admission == "off" && inPause <= 2:
				// The control: more than the limiter's bound, or the test cannot tell the
				// two apart. Usually 6 to 8 (each slot meets a 429 of its own); a loaded
				// machine saw 4 (slots between jobs when the pause began).
				t.Fatalf("without the limiter only %d more requests met the pause: the test cannot tell the two apart", inPause)
			}
		})
	}
}

// pausedFleet runs the scenario of TestOne429PausesEveryWorkProcess and returns how
// many requests besides the first met the pause (were refused 429) later than 25ms
// after it (the ones before left while the 429 was on its way back).
func pausedFleet(t *testing.T, admission string) int {
	fs, err := fakeserver.New(fakeserver.Config{Latency: 100 * time.Millisecond, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	const pause = 3 * time.Second
	const raceAllowance = 25 * time.Millisecond
	var mu sync.Mutex
	var pausedAt time.Time
	byKey := map[string]int{}
	inPause := 0
	var late []string
	model := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			fs.ServeHTTP(w, r)
			return
		}
		mu.Lock()
		now := time.Now()
		byKey[r.Header.Get("Authorization")]++
		switch {
		case pausedAt.IsZero() && byKey["Bearer sk-test-one"] >= 3 && byKey["Bearer sk-test-two"] >= 3:
			pausedAt = now
		case !pausedAt.IsZero() && now.Sub(pausedAt) < pause:
			// A request that arrives within raceAllowance of the 429 left before any
			// process could have read it (the 429 travels back, the pause is announced):
			// it is refused like the others but not counted against the limiter.
			if now.Sub(pausedAt) >= raceAllowance {
				inPause++
			}
			late = append(late, fmt.Sprintf("%s +%v", r.Header.Get("Authorization")[7:], now.Sub(pausedAt).Round(time.Millisecond)))
		default:
			mu.Unlock()
			fs.ServeHTTP(w, r)
			return
		}
		left := pause - now.Sub(pausedAt)
		mu.Unlock()
		w.Header().Set("Retry-After", fmt.Sprint(int(left.Seconds()+0.999)))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"error":{"message":"Rate limit reached for requests","type":"requests","param":null,"code":"rate_limit_exceeded"}}`)
	}))
	t.Cleanup(model.Close)
	pool, dsn := testenv.Postgres(t)
	env, rdb, keys := workEnv(t, "ONCEFLOW_DATABASE_URL="+dsn, "ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL="+model.URL+"/v1",
		"ONCEFLOW_LLM_ADMISSION="+admission, "ONCEFLOW_WORKER_CONCURRENCY=4", "ONCEFLOW_CLAIM_IDLE=10s", "ONCEFLOW_MAX_DELIVERIES=2")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const jobs = 120
	for i := range jobs {
		req := summaries.Request{Text: fmt.Sprintf("Ticket %d: the export fails with a timeout.", i), Notify: "team@example.com"}
		id := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
		if _, err := queue.Enqueue(ctx, rdb, keys, queue.Message{JobID: id, Tenant: "acme", Payload: req.Canonical()}); err != nil {
			t.Fatal(err)
		}
	}
	one := startWork(t, append(env, "OPENAI_API_KEY=sk-test-one"))
	two := startWork(t, append(env, "OPENAI_API_KEY=sk-test-two"))
	testenv.WaitFor(t, 50*time.Second, "every job summarised", func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM summaries`).Scan(&n) == nil && n == jobs
	})
	for _, p := range []*testenv.Process{one, two} {
		p.Signal(syscall.SIGTERM)
		if code := p.Wait(15 * time.Second); code != 0 {
			t.Fatalf("exit %d", code)
		}
	}
	if n := rdb.XLen(ctx, keys.Dead()).Val(); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if pausedAt.IsZero() {
		t.Fatal("the provider never answered 429: both processes did not call it")
	}
	t.Logf("admission %s: %d requests in the pause %v; by process %v", admission, inPause, late, byKey)
	return inPause
}
