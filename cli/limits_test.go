package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
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
	// Two work processes whose requests' arrival times decide it: under make test's
	// parallel -race load a request sent before the pause reached the provider 126ms
	// late and counted as meeting it. make test-long runs it with the machine to itself.
	testenv.Long(t)
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
// after it (the ones before left while the 429 was on its way back). With the limiter
// on, the count starts 25ms after the pause was announced to the fleet instead (the
// first "model paused for every process" a process logged, after its write to Redis):
// a request sent before then could not have known, and under load the 429's way back
// and the announcement have taken 160ms.
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
	type refusal struct {
		key string
		at  time.Time
	}
	var refused []refusal
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
			refused = append(refused, refusal{r.Header.Get("Authorization")[7:], now})
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
	// A request that arrives within raceAllowance of the 429 (with the limiter, of the
	// pause's announcement) left before any process could have known: it is refused
	// like the others but not counted against the limiter.
	from := pausedAt
	if admission == "on" {
		announced := firstLogTime(t, "limiter: model paused for every process", one, two)
		if announced.IsZero() || announced.Sub(pausedAt) >= pause {
			t.Fatalf("no process announced the pause within its %v (announced at %v, pause at %v)", pause, announced, pausedAt)
		}
		if announced.After(from) {
			from = announced
		}
		t.Logf("the pause was announced %v after the 429", announced.Sub(pausedAt).Round(time.Millisecond))
	}
	inPause := 0
	var late []string
	for _, r := range refused {
		if r.at.Sub(from) >= raceAllowance {
			inPause++
		}
		late = append(late, fmt.Sprintf("%s +%v", r.key, r.at.Sub(pausedAt).Round(time.Millisecond)))
	}
	t.Logf("admission %s: %d requests in the pause %v; by process %v", admission, inPause, late, byKey)
	return inPause
}

// firstLogTime returns the earliest time at which one of ps logged a JSON line whose
// "msg" is msg, or the zero time when none did.
func firstLogTime(t *testing.T, msg string, ps ...*testenv.Process) time.Time {
	t.Helper()
	var first time.Time
	for _, p := range ps {
		for _, l := range p.Logs(msg) {
			s, _ := l["time"].(string)
			at, err := time.Parse(time.RFC3339Nano, s)
			if err != nil {
				t.Fatalf("%q logged with a time of %q: %v", msg, s, err)
			}
			if first.IsZero() || at.Before(first) {
				first = at
			}
		}
	}
	return first
}

// Shadows take only the capacity production leaves of the provider's limit. `onceflow
// run` shadows every summary (ONCEFLOW_SHADOW=summary=gpt-4.1-mini@1) on production's
// own model, the case where the two share one limit: `onceflow fake-llm --rpm 120`
// keeps one bucket of 120 requests a minute (refilling 2 a second) per model, and the
// limiter is told the same (ONCEFLOW_LLM_RPM=120). (A candidate of another model has
// buckets of its own, at the provider and in the limiter alike: it could not take
// production's requests whatever the limiter did.) A bucket starts full, a minute of
// the limit, which a test of seconds would never exhaust; so the fleet has used 75 of
// the minute's requests (through the limiter, as another process would) when 42
// summaries arrive at 6 a second. Production alone fits (42 requests in 7 s, against
// the 45 left and 14 refilled); production and its shadows (84) do not. With the
// limiter, a shadow runs only while a quarter of the limit stays free, then waits:
// production meets no 429 at the provider (its calls told from the shadows' by their
// Idempotency-Key, the ledger key) and completes, some shadows ran and others were put
// off. The control, the same load with the limiter off, makes production meet the
// limit: the first assertion is not vacuous.
func TestShadowsLeaveProductionTheProvidersLimit(t *testing.T) {
	testenv.Long(t) // fake-llm and onceflow run as processes, 7 s of paced load each
	t.Parallel()
	testenv.Binary(t) // built before the clocks start
	for _, admission := range []string{"on", "off"} {
		t.Run("admission="+admission, func(t *testing.T) {
			t.Parallel()
			shadowedLoad(t, admission)
		})
	}
}

// shadowedLoad runs the scenario of TestShadowsLeaveProductionTheProvidersLimit with
// the limiter on or off and checks its outcome.
func shadowedLoad(t *testing.T, admission string) {
	const (
		model    = "gpt-4.1-mini"
		rpm      = 120
		used     = 75 // of the minute's requests, before production's load
		jobs     = 42
		interval = time.Second / 6
	)
	_, base := startFakeLLM(t, "--rpm", fmt.Sprint(rpm), "--latency", "100ms")
	rdb, prefix := testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	p := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0",
		"ONCEFLOW_LLM=openai", "ONCEFLOW_LLM_BASE_URL=" + base, "OPENAI_API_KEY=sk-test-shadows", "ONCEFLOW_LLM_MODEL=" + model,
		"ONCEFLOW_LLM_ADMISSION=" + admission, fmt.Sprintf("ONCEFLOW_LLM_RPM=%d", rpm),
		"ONCEFLOW_SHADOW=summary=" + model + "@1", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
	}, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	api := fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])

	// The minute's earlier calls, through a limiter on the same keys, so that it and
	// the provider agree on what is left.
	lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, Provider: "openai", Limits: limiter.Limits{RPM: rpm}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	earlier := lim.Wrap(openai.New(openai.Config{BaseURL: base, APIKey: "sk-test-shadows"}))
	var wg sync.WaitGroup
	errs := make(chan error, used)
	for i := range used {
		wg.Go(func() {
			_, err := earlier.Complete(limiter.WithTenant(ctx, "earlier"), &llm.Request{Model: model,
				Messages: []llm.Message{{Role: llm.RoleUser, Content: fmt.Sprintf("Earlier call %d.", i)}}})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("an earlier call: %v", err)
		}
	}

	// Production: 42 summaries at 6 a second.
	var works []string
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for i := range jobs {
		r, err := postSummary(ctx, http.DefaultClient, api, testKeyAcme, fmt.Sprintf("shadowed-load-key-%04d", i),
			summaryBody(fmt.Sprintf("Ticket %d: the nightly export fails with a timeout.", i)))
		var accepted struct {
			JobID string `json:"job_id"`
		}
		if err != nil || r.code != http.StatusAccepted || json.Unmarshal(r.body, &accepted) != nil {
			t.Fatalf("POST %d: %v %d %s", i, err, r.code, r.body)
		}
		works = append(works, ledger.Work(accepted.JobID, "summary"))
		<-tick.C
	}
	// A call's Idempotency-Key is its ledger key; production's are those of the jobs'
	// step "summary" (a shadow's step is "candidate", of a shadow job).
	stats := func() (prod429, other429 int64, st fakeserver.Stats) {
		st, err := fakeserver.FetchStats(ctx, nil, base)
		if err != nil {
			t.Fatal(err)
		}
		rows, err := pool.Query(ctx, `SELECT idem_key FROM llm_calls WHERE work = ANY($1)`, works)
		if err != nil {
			t.Fatal(err)
		}
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		prodKeys := map[string]bool{}
		for _, k := range keys {
			prodKeys[k] = true
		}
		for k, n := range st.RateLimitedByIdempotencyKey {
			if prodKeys[k] {
				prod429 += n
			} else {
				other429 += n
			}
		}
		return prod429, other429, st
	}
	count := func(table string) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	if admission == "off" {
		// Shadows sent as soon as they come take the requests production needs.
		testenv.WaitFor(t, 30*time.Second, "a production call refused by the provider", func() bool {
			prod429, _, _ := stats()
			return prod429 > 0
		})
		prod429, other429, st := stats()
		t.Logf("limiter off: production met %d 429s, shadows %d; %d requests in all", prod429, other429, st.Requests)
		return
	}
	testenv.WaitFor(t, 40*time.Second, "every production job summarised", func() bool { return count("summaries") == jobs })
	shadows := count("shadow_runs")
	prod429, other429, st := stats()
	samples, _ := scrape(t, api+"/metrics")
	putOff := samples[`onceflow_llm_admission_deferred_total{model="`+model+`",reason="headroom"}`] +
		samples[`onceflow_llm_admission_deferred_total{model="`+model+`",reason="others first"}`]
	t.Logf("limiter on: production met %d 429s, shadows %d; %d requests in all; %d shadow runs when production was done; shadows put off %v times",
		prod429, other429, st.Requests, shadows, putOff)
	switch {
	case prod429 != 0:
		t.Fatalf("production met %d 429s at the provider, want none", prod429)
	case shadows == 0:
		t.Fatal("no shadow ran: the test shows nothing of how shadows share the limit")
	case putOff == 0 || shadows == jobs:
		t.Fatalf("%d shadow runs, put off %v times: the shadows were never held back, so the load did not exceed the limit", shadows, putOff)
	}
}
