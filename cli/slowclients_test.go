package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// slowEnv gives a process one second to send a request's headers and one more for its
// body (the defaults are 10s and 30s).
var slowEnv = []string{"ONCEFLOW_HTTP_READ_TIMEOUT=1s", "ONCEFLOW_HTTP_READ_HEADER_TIMEOUT=1s"}

// cutOffWithin is how long a slow client may hold a connection in these tests: far more
// than the second configured, far less than the defaults.
const cutOffWithin = 7 * time.Second

// trickleBody is the body a trickling client announces: 1 MiB, the largest the
// summaries route accepts.
const trickleBody = 1 << 20

// slowTarget is a listener under test and how to talk to it.
type slowTarget struct {
	addr string
	// normal sends the i-th normal request and returns its status; want is the status
	// it must get.
	normal func(ctx context.Context, i int) (int, error)
	want   int
}

// answer is what a raw-connection client read back.
type answer struct {
	code   int
	close  bool // the server announced or did close the connection
	body   string
	after  time.Duration
	closed bool // a read after the answer found the connection closed
}

// trickle sends head to addr, then a body one byte every 100ms, and reads the answer
// meanwhile. The error says that no answer came within cutOffWithin.
func trickle(addr, head string) (answer, error) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return answer{}, err
	}
	defer conn.Close()
	start := time.Now()
	if _, err := io.WriteString(conn, head); err != nil {
		return answer{}, err
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := conn.Write([]byte("x")); err != nil {
					return // the server closed the connection
				}
			}
		}
	})
	defer wg.Wait()
	defer close(stop)
	_ = conn.SetReadDeadline(start.Add(cutOffWithin))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return answer{}, fmt.Errorf("a client trickling its body got no answer after %v: %w", time.Since(start).Round(time.Millisecond), err)
	}
	a := answer{code: resp.StatusCode, close: resp.Close, after: time.Since(start)}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	a.body = string(b)
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	var one [1]byte
	_, err = br.Read(one[:])
	var ne net.Error
	a.closed = err != nil && !(errors.As(err, &ne) && ne.Timeout())
	return a, nil
}

// slowHeaders sends a request line and then a header one byte every 100ms; it returns
// how long the server took to drop the connection and what it sent, if anything.
func slowHeaders(t *testing.T, addr string) (time.Duration, string) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: %s\r\nX-Slow: ", addr)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
				if _, err := conn.Write([]byte("a")); err != nil {
					return
				}
			}
		}
	})
	defer wg.Wait()
	defer close(stop)
	_ = conn.SetReadDeadline(start.Add(cutOffWithin))
	got, err := io.ReadAll(conn)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Errorf("a client trickling its headers still held its connection after %v", time.Since(start).Round(time.Millisecond))
	}
	return time.Since(start), string(got)
}

// bigHeader sends a request with a 100 KiB header and returns the status it gets.
func bigHeader(t *testing.T, addr string) int {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	go fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: %s\r\nX-Big: %s\r\n\r\n", addr, strings.Repeat("a", 100<<10))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("a request with a 100 KiB header: %v", err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// checkSlowClients runs clients trickling their bodies (one per head) against tg while
// normal clients keep sending requests, then a client trickling its headers and one
// sending oversized headers. The tricklers must be answered 408 with a JSON body naming
// the problem and disconnected; every normal request must get tg.want. It returns the
// number of normal requests served and the tricklers' answers.
func checkSlowClients(t *testing.T, tg slowTarget, heads ...string) (int, []answer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	answers := make([]answer, len(heads))
	errs := make([]error, len(heads))
	var tricklers sync.WaitGroup
	for i, head := range heads {
		tricklers.Go(func() { answers[i], errs[i] = trickle(tg.addr, head) })
	}
	done := make(chan struct{})
	go func() { tricklers.Wait(); close(done) }()
	served := 0
	var wrong []string
normal:
	for i := 0; ; i++ {
		select {
		case <-done:
			break normal
		default:
		}
		code, err := tg.normal(ctx, i)
		if err != nil || code != tg.want {
			wrong = append(wrong, fmt.Sprintf("request %d: %d %v", i, code, err))
			continue
		}
		served++
		time.Sleep(20 * time.Millisecond)
	}
	for i, a := range answers {
		if errs[i] != nil {
			t.Errorf("trickler %d: %v", i, errs[i])
			continue
		}
		if a.code != http.StatusRequestTimeout || !json.Valid([]byte(a.body)) || !strings.Contains(a.body, "request body") {
			t.Errorf("trickler %d: got %d %q after %v, want 408 with a JSON body naming the request body", i, a.code, a.body, a.after)
		}
		if !a.close || !a.closed {
			t.Errorf("trickler %d: connection not closed after the 408 (Connection: close %v, closed %v)", i, a.close, a.closed)
		}
	}
	// At least one normal request served while the tricklers held their connections
	// open (about the read timeout, a second): on a loaded machine one keyed request may
	// take most of that second, so more than one is not asked for.
	if len(wrong) > 0 || served < 1 {
		t.Errorf("normal clients while the tricklers held on: %d served, wrong answers %v", served, wrong)
	}
	after, got := slowHeaders(t, tg.addr)
	if got != "" {
		t.Errorf("a client trickling its headers got %q", got)
	}
	t.Logf("tricklers answered after %v; slow headers dropped after %v", answers[0].after.Round(time.Millisecond), after.Round(time.Millisecond))
	if code := bigHeader(t, tg.addr); code != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("a 100 KiB header got %d, want 431", code)
	}
	return served, answers
}

// apiTarget is serve's or run's POST /v1/summaries at base, and the head of a request
// to it announcing a 1 MiB body.
func apiTarget(base string) (slowTarget, string) {
	addr := strings.TrimPrefix(base, "http://")
	client := &http.Client{Timeout: 5 * time.Second}
	head := fmt.Sprintf("POST /v1/summaries HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nIdempotency-Key: trickler-key-000000001\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n", addr, testKeyAcme, trickleBody)
	return slowTarget{
		addr: addr,
		normal: func(ctx context.Context, i int) (int, error) {
			r, err := postSummary(ctx, client, base, testKeyAcme, fmt.Sprintf("normal-key-%012d", i), summaryBody(fmt.Sprintf("note %d", i)))
			return r.code, err
		},
		want: http.StatusAccepted,
	}, head
}

// serve answers a client that trickles its body 408 and drops one that trickles its
// headers, while the other clients are served; no job is enqueued for the trickler.
func TestServeCutsOffSlowClients(t *testing.T) {
	t.Parallel()

	rdb, prefix := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	_, base := startServe(t, append([]string{"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t),
		"ONCEFLOW_PREFIX=" + prefix, "ONCEFLOW_DATABASE_URL=" + dsn}, slowEnv...)...)
	tg, head := apiTarget(base)
	served, _ := checkSlowClients(t, tg, head)
	keys := queue.Keys{Prefix: prefix, Queue: summaries.QueueName}
	if n, err := rdb.XLen(context.Background(), keys.Stream()).Result(); err != nil || n != int64(served) {
		t.Fatalf("%d jobs enqueued (%v) for %d normal requests served", n, err, served)
	}
}

// run serves the API through the same server: the same limits hold.
func TestRunCutsOffSlowClients(t *testing.T) {
	t.Parallel()
	_, prefix := testenv.Redis(t)
	_, dsn := testenv.Postgres(t)
	p := testenv.Start(t, testenv.Binary(t), append([]string{
		"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
	}, slowEnv...), "run")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	base := fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])
	tg, head := apiTarget(base)
	checkSlowClients(t, tg, head)
}

// slowStream is an upstream answer streamed over 2.5 seconds, longer than the read
// timeout: the gateway must pass it on whole.
func slowStream(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	for i := range 5 {
		fmt.Fprintf(w, "data: {\"id\":\"chatcmpl-slow\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"part %d \"}}]}\n\n", i)
		_ = rc.Flush()
		time.Sleep(500 * time.Millisecond)
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

// The gateway answers clients trickling their bodies 408, keyed or not, while normal
// clients are served; the keyed trickler's call never reaches the upstream. Answers
// that stream for longer than the read timeout are not cut.
func TestGatewayCutsOffSlowClients(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	fake, err := fakeserver.New(fakeserver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Test-Stream-Slowly") != "" {
			slowStream(w, r)
			return
		}
		fake.ServeHTTP(w, r)
	}))
	t.Cleanup(upstream.Close)
	_, gwURL := startGateway(t, dsn, upstream.URL+"/v1", slowEnv...)
	addr := strings.TrimPrefix(strings.TrimSuffix(gwURL, "/v1"), "http://")

	// Two streams longer than the read timeout, one keyed and one passed through.
	streams := make([]string, 2)
	var streaming sync.WaitGroup
	for i, key := range []string{"stream-key-0000000001", ""} {
		streaming.Go(func() {
			req, _ := http.NewRequest(http.MethodPost, gwURL+"/chat/completions",
				strings.NewReader(`{"model":"gpt-4.1-mini","stream":true,"messages":[{"role":"user","content":"slowly"}]}`))
			req.Header.Set("Authorization", "Bearer sk-test")
			req.Header.Set("X-Test-Stream-Slowly", "1")
			if key != "" {
				req.Header.Set("Idempotency-Key", key)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				streams[i] = err.Error()
				return
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			streams[i] = fmt.Sprintf("%d %s %v", resp.StatusCode, b, err)
		})
	}

	head := func(key string) string {
		h := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n", addr, trickleBody)
		if key != "" {
			h += "Idempotency-Key: " + key + "\r\n"
		}
		return h + "\r\n"
	}
	tg := slowTarget{
		addr: addr,
		normal: func(ctx context.Context, i int) (int, error) {
			code, _, err := keyedPost(gwURL, fmt.Sprintf("normal-key-%012d", i))
			return code, err
		},
		want: http.StatusOK,
	}
	served, answers := checkSlowClients(t, tg, head("trickler-key-000000001"), head(""))
	if !strings.Contains(answers[0].body, `"request_timeout"`) {
		t.Errorf("the keyed trickler got %s, want the gateway's own error, request_timeout", answers[0].body)
	}
	streaming.Wait()
	for i, s := range streams {
		if !strings.HasPrefix(s, "200 ") || !strings.Contains(s, "part 4") || !strings.Contains(s, "[DONE]") || !strings.HasSuffix(s, " <nil>") {
			t.Errorf("stream %d, longer than the read timeout, was cut: %s", i, s)
		}
	}
	st := fake.Stats()
	scope := gateway.CredentialScope(http.Header{"Authorization": {"Bearer sk-test"}})
	keyed := 0
	for i := range served + 1 {
		keyed += int(st.ByIdempotencyKey[gateway.KeyFor(scope, fmt.Sprintf("normal-key-%012d", i))])
	}
	if keyed != served || st.ByIdempotencyKey[gateway.KeyFor(scope, "trickler-key-000000001")] != 0 {
		t.Fatalf("upstream calls: %d for %d normal requests served, %d for the keyed trickler", keyed, served,
			st.ByIdempotencyKey[gateway.KeyFor(scope, "trickler-key-000000001")])
	}
}

// The webhook sink answers a client trickling its body 408 and records nothing for it.
func TestWebhookSinkCutsOffSlowClients(t *testing.T) {
	t.Parallel()
	p := testenv.Start(t, testenv.Binary(t), slowEnv, "webhook-sink", "--addr", "127.0.0.1:0")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	addr := fmt.Sprint(p.WaitLog(ctx, "webhook sink listening")["addr"])
	client := &http.Client{Timeout: 5 * time.Second}
	tg := slowTarget{
		addr: addr,
		normal: func(ctx context.Context, i int) (int, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr, strings.NewReader(`{"n":1}`))
			req.Header.Set("Idempotency-Key", fmt.Sprintf("normal-key-%012d", i))
			resp, err := client.Do(req)
			if err != nil {
				return 0, err
			}
			resp.Body.Close()
			return resp.StatusCode, nil
		},
		want: http.StatusOK,
	}
	served, _ := checkSlowClients(t, tg, fmt.Sprintf("POST / HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: trickler-key-000000001\r\nContent-Length: %d\r\n\r\n", addr, trickleBody))
	resp, err := client.Get("http://" + addr + "/?deliveries=1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		Deliveries int `json:"deliveries"`
		Delivered  []struct {
			Key string `json:"idempotency_key"`
		} `json:"delivered"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	for _, d := range st.Delivered {
		if d.Key == "trickler-key-000000001" {
			t.Errorf("the trickler's delivery was recorded")
		}
	}
	if st.Deliveries != served {
		t.Fatalf("%d deliveries recorded for %d normal requests served", st.Deliveries, served)
	}
}
