package gateway_test

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// fleet is n gateways sharing one llm_calls table, as the processes of a fleet do.
type fleet struct {
	urls []string // each gateway's /v1
	regs []*prometheus.Registry
	pool *pgxpool.Pool
}

// gatewaysOn starts n gateways in front of up, sharing one llm_calls table.
func gatewaysOn(t *testing.T, up http.Handler, n int, cfg gateway.Config) *fleet {
	t.Helper()
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	fl := &fleet{pool: pool}
	for range n {
		c := cfg
		reg := prometheus.NewRegistry()
		c.Upstream, c.DB, c.Logger, c.Registerer = ups.URL+"/v1", pool, testenv.Logger(t), reg
		g, err := gateway.New(c)
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		fl.urls = append(fl.urls, gs.URL+"/v1")
		fl.regs = append(fl.regs, reg)
	}
	return fl
}

// waitJoining waits until n requests are joining a call on gateway i.
func (fl *fleet) waitJoining(t *testing.T, i, n int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		families, err := fl.regs[i].Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() == "onceflow_gateway_joining" && int(f.GetMetric()[0].GetGauge().GetValue()) >= n {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("gateway %d: fewer than %d requests joined", i, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitUpstreamInFlight waits until fs has a request in flight.
func waitUpstreamInFlight(t *testing.T, fs *fakeserver.Server) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for fs.Stats().InFlight == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no request reached the upstream")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// gatedStream is an upstream whose stream stops after its first events until release is
// closed, then sends the rest. It counts its calls.
type gatedStream struct {
	release chan struct{}
	sent    chan struct{} // closed once the first events are out
	mu      sync.Mutex
	calls   int
}

const (
	gatedHead = "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" second\"}}]}\n\n"
	gatedTail = "data: {\"choices\":[{\"delta\":{\"content\":\" third\"}}]}\n\ndata: [DONE]\n\n"
)

func newGatedStream() *gatedStream {
	return &gatedStream{release: make(chan struct{}), sent: make(chan struct{})}
}

func (u *gatedStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	u.calls++
	first := u.calls == 1
	u.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("X-Request-Id", "req-gated")
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, gatedHead)
	http.NewResponseController(w).Flush()
	if first {
		close(u.sent)
		<-u.release
	}
	_, _ = io.WriteString(w, gatedTail)
}

func (u *gatedStream) Calls() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls
}

// openStream sends a keyed streaming request and returns the response, its body unread.
func openStream(t *testing.T, url, key string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", strings.NewReader(streamBody))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// readEvents reads n events ("data: ...\n\n") from r.
func readEvents(t *testing.T, r *bufio.Reader, n int) string {
	t.Helper()
	var b strings.Builder
	for n > 0 {
		line, err := r.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			t.Fatalf("after %q: %v", b.String(), err)
		}
		if line == "\n" {
			n--
		}
	}
	return b.String()
}

// A streaming request whose key is in flight gets the events the first request got so
// far, at once, then the live tail, byte for byte; on this process (followed in
// memory) and on another gateway process (followed through llm_calls). One upstream
// call.
func TestStreamJoinerGetsTheEventsSoFarThenTheLiveTail(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		other bool
	}{{"same process", false}, {"other process", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			up := newGatedStream()
			fl := gatewaysOn(t, up, 2, gateway.Config{})
			key := "join-stream-" + strings.ReplaceAll(tc.name, " ", "-")
			first := openStream(t, fl.urls[0], key)
			fr := bufio.NewReader(first.Body)
			if got := readEvents(t, fr, 2); got != gatedHead {
				t.Fatalf("first request's head: %q", got)
			}
			<-up.sent
			joinURL := fl.urls[0]
			if tc.other {
				joinURL = fl.urls[1]
			}
			joiner := openStream(t, joinURL, key)
			if joiner.StatusCode != 200 || joiner.Header.Get("Onceflow-Joined") != "true" || joiner.Header.Get("Idempotent-Replayed") != "true" ||
				joiner.Header.Get("X-Request-Id") != "req-gated" || joiner.Header.Get("Content-Type") != "text/event-stream" {
				t.Fatalf("joiner: %d %v", joiner.StatusCode, joiner.Header)
			}
			jr := bufio.NewReader(joiner.Body)
			// The events so far arrive while the upstream still holds the rest back.
			if got := readEvents(t, jr, 2); got != gatedHead {
				t.Fatalf("joiner's head: %q", got)
			}
			close(up.release)
			rest, err := io.ReadAll(fr)
			if err != nil || gatedHead+string(rest) != gatedHead+gatedTail {
				t.Fatalf("first request's tail: %q %v", rest, err)
			}
			jrest, err := io.ReadAll(jr)
			if err != nil || string(jrest) != gatedTail {
				t.Fatalf("joiner's tail: %q %v", jrest, err)
			}
			_, replay, err := streamPost(t, fl.urls[1], key)
			if err != nil || replay != gatedHead+gatedTail {
				t.Fatalf("replay: %q %v", replay, err)
			}
			if n := up.Calls(); n != 1 {
				t.Fatalf("%d upstream calls, want 1", n)
			}
		})
	}
}

// Fifty requests with one key while its call is in flight, half on another gateway
// process: one upstream request, and every one of them gets the first request's answer,
// byte for byte.
func TestFiftyJoinersCostOneUpstreamCall(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Latency: 1500 * time.Millisecond, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 2, gateway.Config{})
	key := "fifty-joiners-key-0001"
	type result struct {
		code   int
		joined string
		body   []byte
	}
	send := func(url string) result {
		req, _ := http.NewRequest(http.MethodPost, url+"/chat/completions", strings.NewReader(chatBody))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Authorization", "Bearer sk")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return result{code: -1, body: []byte(err.Error())}
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return result{resp.StatusCode, resp.Header.Get("Onceflow-Joined"), b}
	}
	firstc := make(chan result, 1)
	go func() { firstc <- send(fl.urls[0]) }()
	waitUpstreamInFlight(t, fs)
	results := make([]result, 50)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() { results[i] = send(fl.urls[i%2]) })
	}
	wg.Wait()
	first := <-firstc
	if first.code != 200 {
		t.Fatalf("first: %d %s", first.code, first.body)
	}
	for i, r := range results {
		if r.code != 200 || !bytes.Equal(r.body, first.body) || r.joined != "true" {
			t.Fatalf("joiner %d (gateway %d): %d joined=%q %s; want the first answer", i, i%2, r.code, r.joined, r.body)
		}
	}
	if n := fs.Stats().Requests; n != 1 {
		t.Fatalf("%d upstream requests for 51 requests with one key, want 1", n)
	}
}

// A joiner of a call whose upstream answered an error gets the same error (the call was
// made once, its answer is not recorded); a later request makes a new attempt.
func TestJoinerOfAFailedCallGetsItsAnswer(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	calls := 0
	release := make(chan struct{})
	up := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 1 {
			<-release
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = io.WriteString(w, `{"error":{"message":"boom","type":"server_error"}}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"ok"}`)
	})
	fl := gatewaysOn(t, up, 1, gateway.Config{})
	key := "joined-failure-key-001"
	codes := make(chan int, 2)
	bodies := make(chan string, 2)
	for range 2 {
		go func() {
			r, b := post(t, fl.urls[0]+"/chat/completions", key, "Bearer sk", chatBody)
			codes <- r.StatusCode
			bodies <- string(b)
		}()
	}
	fl.waitJoining(t, 0, 1) // one request calls, the other joins it
	close(release)
	for range 2 {
		if c, b := <-codes, <-bodies; c != 500 || !strings.Contains(b, "boom") {
			t.Fatalf("answer %d %s, want the upstream's 500", c, b)
		}
	}
	mu.Lock()
	n := calls
	mu.Unlock()
	if n != 1 {
		t.Fatalf("%d upstream calls for two requests of one failed call, want 1", n)
	}
	if r, b := post(t, fl.urls[0]+"/chat/completions", key, "Bearer sk", chatBody); r.StatusCode != 200 || string(b) != `{"id":"ok"}` {
		t.Fatalf("retry after the failure: %d %s", r.StatusCode, b)
	}
}

// A joiner of a stream that is cut halfway (on another process) is cut too: its client
// must see the stream was incomplete; its retry makes the new attempt.
func TestJoinerOfACutStreamIsCut(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	sent := make(chan struct{})
	var mu sync.Mutex
	calls := 0
	up := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, gatedHead)
		http.NewResponseController(w).Flush()
		if n == 1 {
			close(sent)
			<-release
			panic(http.ErrAbortHandler) // the connection drops mid-stream
		}
		_, _ = io.WriteString(w, gatedTail)
	})
	fl := gatewaysOn(t, up, 2, gateway.Config{})
	key := "joined-cut-stream-0001"
	first := openStream(t, fl.urls[0], key)
	<-sent
	joiner := openStream(t, fl.urls[1], key)
	jr := bufio.NewReader(joiner.Body)
	if got := readEvents(t, jr, 2); got != gatedHead {
		t.Fatalf("joiner's head: %q", got)
	}
	close(release)
	if _, err := io.ReadAll(first.Body); err == nil {
		t.Fatal("the first request's stream was cut upstream but ended cleanly")
	}
	if rest, err := io.ReadAll(jr); err == nil {
		t.Fatalf("the joiner's stream ended cleanly (%q) though the call was cut", rest)
	}
	_, body, err := streamPost(t, fl.urls[1], key)
	if err != nil || body != gatedHead+gatedTail {
		t.Fatalf("retry: %q %v", body, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 2 {
		t.Fatalf("%d upstream calls, want 2 (the cut one and the retry)", calls)
	}
}

// With a join timeout, a request whose call in flight has not answered within it gets
// 409 with Retry-After and retry-after-ms, and no upstream call.
func TestJoinTimeoutAnswers409(t *testing.T) {
	t.Parallel()
	fs, err := fakeserver.New(fakeserver.Config{Latency: 2 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fs.Close)
	fl := gatewaysOn(t, fs, 2, gateway.Config{JoinTimeout: 300 * time.Millisecond, RetryAfter: 1500 * time.Millisecond})
	key := "join-timeout-key-00001"
	go func() { _, _ = post(t, fl.urls[0]+"/chat/completions", key, "Bearer sk", chatBody) }()
	waitUpstreamInFlight(t, fs)
	for i, url := range fl.urls {
		r, b := post(t, url+"/chat/completions", key, "Bearer sk", chatBody)
		if r.StatusCode != http.StatusConflict || r.Header.Get("Retry-After") != "2" || r.Header.Get("retry-after-ms") != "1500" {
			t.Fatalf("gateway %d: %d %v %s, want 409 with Retry-After 2 and retry-after-ms 1500", i, r.StatusCode, r.Header, b)
		}
	}
	if n := fs.Stats().Requests; n != 1 {
		t.Fatalf("%d upstream requests", n)
	}
}
