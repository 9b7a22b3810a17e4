package gateway_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

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
	// 4s: under make test's -race load a joiner reached the gateway after 1.5s, once the
	// answer was recorded, and was replayed instead of joined.
	fs, err := fakeserver.New(fakeserver.Config{Latency: 4 * time.Second, Logger: testenv.Logger(t)})
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

// stalledClient sends a keyed streaming request over a raw connection with a 4 KiB
// receive buffer and never reads the answer, as a client that is suspended (a laptop
// lid closed, a process stopped in a debugger, a consumer stuck on its first event)
// does while its connection stays open.
func stalledClient(t *testing.T, gatewayV1, key string) net.Conn {
	t.Helper()
	host := strings.TrimPrefix(strings.TrimSuffix(gatewayV1, "/v1"), "http://")
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	req := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAuthorization: Bearer sk\r\n"+
		"Idempotency-Key: %s\r\nContent-Length: %d\r\n\r\n%s", host, key, len(streamBody), streamBody)
	if _, err := io.WriteString(conn, req); err != nil {
		t.Fatal(err)
	}
	return conn
}

// A client that opened a stream and stopped reading (its connection still open) holds
// back no other request for its key, whoever's it is; one upstream call.
func TestAStalledClientHoldsBackNobody(t *testing.T) {
	t.Parallel()
	// A joiner whose client stopped reading (on the owner's process and on another) holds
	// back neither the owner nor the other joiners: they get the whole stream in time, and
	// the answer is recorded, from one upstream call.
	t.Run("a joiner's", func(t *testing.T) {
		t.Parallel()
		up := newBigStream(3 << 10)
		fl := gatewaysOn(t, up, 2, gateway.Config{Timeout: 15 * time.Second,
			Ledger: ledger.Config{StreamFlushBytes: 64 << 20}})
		key := "stalled-joiner-key-0001"
		owner := openStream(t, fl.urls[0], key)
		<-up.sent
		stalledClient(t, fl.urls[0], key)
		stalledClient(t, fl.urls[1], key)
		fl.waitJoining(t, 0, 1)
		fl.waitJoining(t, 1, 1)
		joiner := openStream(t, fl.urls[0], key)
		close(up.release)
		want := up.whole()
		done := make(chan error, 2)
		for _, r := range []*http.Response{owner, joiner} {
			go func() {
				b, err := io.ReadAll(r.Body)
				if err == nil && string(b) != want {
					err = fmt.Errorf("%d bytes, want %d", len(b), len(want))
				}
				done <- err
			}()
		}
		for range 2 {
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(8 * time.Second):
				t.Fatal("a stalled joiner held back the owner or another joiner")
			}
		}
		_, replay, err := streamPost(t, fl.urls[1], key)
		if err != nil || replay != want {
			t.Fatalf("replay: %d bytes %v", len(replay), err)
		}
		if c := up.calls.Load(); c != 1 {
			t.Fatalf("%d upstream calls, want 1", c)
		}
	})
	// A client that opened a stream and stopped reading (its connection still open) must
	// not hold back the call that every other request for its key follows: a joiner on this
	// process and one on another each get the whole stream, with one upstream call.
	t.Run("the owner's", func(t *testing.T) {
		t.Parallel()
		for _, other := range []bool{false, true} {
			t.Run(fmt.Sprintf("joiner on other process=%v", other), func(t *testing.T) {
				t.Parallel()
				up := newBigStream(3 << 10) // about 3 MiB, beyond the socket buffers
				// Partials flushed on the timer only: PostgreSQL is not what holds the
				// stream back here (TestLargeStreamIsNotSlowedByItsPartials).
				fl := gatewaysOn(t, up, 2, gateway.Config{Timeout: 15 * time.Second,
					Ledger: ledger.Config{StreamFlushBytes: 64 << 20}})
				key := fmt.Sprintf("stalled-owner-%v-0001", other)
				stalledClient(t, fl.urls[0], key)
				<-up.sent
				url := fl.urls[0]
				if other {
					url = fl.urls[1]
				}
				joiner := openStream(t, url, key)
				if joiner.Header.Get("Onceflow-Joined") != "true" {
					t.Fatalf("the second request did not join: %d %v", joiner.StatusCode, joiner.Header)
				}
				close(up.release)
				type read struct {
					b   []byte
					err error
				}
				got := make(chan read, 1)
				var n atomic.Int64
				go func() {
					var b strings.Builder
					buf := make([]byte, 64<<10)
					for {
						k, err := joiner.Body.Read(buf)
						b.Write(buf[:k])
						n.Add(int64(k))
						if err == io.EOF {
							got <- read{b: []byte(b.String())}
							return
						}
						if err != nil {
							got <- read{b: []byte(b.String()), err: err}
							return
						}
					}
				}()
				want := up.whole()
				select {
				case r := <-got:
					if r.err != nil || string(r.b) != want {
						t.Fatalf("joiner: %d bytes, err %v; want the whole stream (%d bytes)", len(r.b), r.err, len(want))
					}
				case <-time.After(8 * time.Second):
					t.Fatalf("the joiner got %d of the stream's %d bytes in 8 s: a client that stopped reading holds back the call every joiner follows",
						n.Load(), len(want))
				}
				if c := up.calls.Load(); c != 1 {
					t.Fatalf("%d upstream calls, want 1", c)
				}
			})
		}
	})
}

// While tenant A's keyed call is in flight, the same Idempotency-Key and body under
// another credential (B, none, or A's plus another credential header), for every
// protocol, is a call of its own on either process: it never joins A's call. Holds (a
// regression test).
func TestKeyedJoinNeverCrossesCredentials(t *testing.T) {
	t.Parallel()
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{Latency: 700 * time.Millisecond, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			fl := gatewaysOn(t, fs, 2, gateway.Config{})
			key := "cross-credential-join-" + strings.ReplaceAll(p.name, " ", "-")
			firstc := make(chan protoAnswer, 1)
			go func() { firstc <- protoPost(fl.urls[0], p, false, key, "secret-a") }()
			waitUpstreamInFlight(t, fs)
			strangers := []func(h http.Header){
				func(h http.Header) { p.cred(h, "secret-b") },
				func(h http.Header) {},
				func(h http.Header) { p.cred(h, "secret-a"); h.Add("Api-Key", "other") },
			}
			answers := make([]protoAnswer, 2*len(strangers))
			var wg sync.WaitGroup
			for i := range answers {
				wg.Go(func() {
					req, _ := http.NewRequest(http.MethodPost, fl.urls[i%2]+p.path, strings.NewReader(strings.Replace(p.body, "%s", "", 1)))
					req.Header.Set("Idempotency-Key", key)
					strangers[i/2](req.Header)
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						answers[i] = protoAnswer{err: err}
						return
					}
					defer resp.Body.Close()
					b, err := io.ReadAll(resp.Body)
					answers[i] = protoAnswer{resp.StatusCode, resp.Header.Get("Onceflow-Joined"), resp.Header.Get("Idempotent-Replayed"), "", b, err}
				})
			}
			wg.Wait()
			first := <-firstc
			if first.status != 200 {
				t.Fatalf("first: %+v", first)
			}
			// Two requests of one stranger share the stranger's own call (one joins
			// the other); none may get A's answer.
			for i, a := range answers {
				if a.err != nil || a.status != 200 || bytes.Equal(a.body, first.body) {
					t.Fatalf("stranger %d (gateway %d): %d joined=%q replayed=%q err=%v: want a call of its own, not A's answer", i/2, i%2, a.status, a.joined, a.replay, a.err)
				}
			}
			if n := fs.Stats().Requests; n != 1+int64(len(strangers)) {
				t.Fatalf("%d upstream calls, want %d (A's and one per stranger)", n, 1+len(strangers))
			}
		})
	}
}

// peakHeap samples the heap in use until stop is closed and returns the largest value.
func peakHeap(stop <-chan struct{}) <-chan uint64 {
	out := make(chan uint64, 1)
	go func() {
		var peak uint64
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			peak = max(peak, m.HeapInuse)
			select {
			case <-stop:
				out <- peak
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	return out
}

// joinedStreamPeak runs one stream of up with n joiners on the owner's process, every
// client reading as fast as it can, and returns the peak heap in use above the heap
// before the call.
func joinedStreamPeak(t *testing.T, n int) uint64 {
	up := newBigStream(4 << 10) // about 4 MiB
	fl := gatewaysOn(t, up, 1, gateway.Config{Timeout: 30 * time.Second,
		Ledger: ledger.Config{StreamFlushBytes: 64 << 20}}) // PostgreSQL is not what this measures
	key := fmt.Sprintf("joiner-memory-%03d-0001", n)
	owner := openStream(t, fl.urls[0], key)
	<-up.sent
	joiners := make([]*http.Response, n)
	for i := range joiners {
		joiners[i] = openStream(t, fl.urls[0], key)
	}
	fl.waitJoining(t, 0, n)
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	base := m.HeapInuse
	stop := make(chan struct{})
	peak := peakHeap(stop)
	close(up.release)
	want := up.whole()
	var wg sync.WaitGroup
	for _, r := range append(joiners, owner) {
		wg.Go(func() {
			n, err := io.Copy(io.Discard, r.Body)
			if err != nil || n != int64(len(want)) {
				t.Errorf("a client got %d bytes (%v), want %d", n, err, len(want))
			}
		})
	}
	wg.Wait()
	close(stop)
	if c := up.calls.Load(); c != 1 {
		t.Fatalf("%d upstream calls, want 1", c)
	}
	return max(<-peak, base) - base
}

// Following a stream costs a joiner a counter, not a copy of the stream: 15 more
// joiners of a 4 MiB stream cost less than two streams' size of heap in all. Found on
// 2b9177d: each joiner kept every byte it passed on (joiner.sent), so memory grew with
// joiners × stream size (15 more joiners: 130 MiB).
func TestJoinersDoNotEachCopyTheStream(t *testing.T) {
	// Not parallel: the heap is the process's. Frequent collections keep garbage out
	// of the measure.
	defer debug.SetGCPercent(debug.SetGCPercent(20))
	one := joinedStreamPeak(t, 1)
	many := joinedStreamPeak(t, 16)
	const size = 4 << 20
	t.Logf("peak heap above the start: 1 joiner %d MiB, 16 joiners %d MiB (the stream: %d MiB)", one>>20, many>>20, size>>20)
	if many > one+2*size {
		t.Fatalf("15 more joiners of an %d MiB stream cost %d MiB more heap: each joiner keeps a copy of the stream",
			size>>20, (many-one)>>20)
	}
}

// PostgreSQL restarts (a failover, a minor-version upgrade, a crash) while a stream is
// joined from another gateway process: the joiner, which already passes the stream on,
// rides out the outage and ends with the whole stream, as the owner's client does; one
// upstream call.
func TestJoinerRidesOutAPostgresRestart(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	pg, urls := privateFleet(t, up, gateway.Config{Timeout: 30 * time.Second})
	key := "pg-restart-joiner-0001"
	owner := openStream(t, urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 2); got != gatedHead {
		t.Fatalf("owner's head: %q", got)
	}
	<-up.sent
	joiner := openStream(t, urls[1], key)
	if joiner.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("did not join: %d %v", joiner.StatusCode, joiner.Header)
	}
	jr := bufio.NewReader(joiner.Body)
	if got := readEvents(t, jr, 2); got != gatedHead {
		t.Fatalf("joiner's head: %q", got)
	}
	start := time.Now()
	pg.Stop()
	time.Sleep(500 * time.Millisecond) // a few of the joiner's polls
	pg.Start()
	t.Logf("PostgreSQL was down for %v", time.Since(start).Round(time.Millisecond))
	close(up.release)
	rest, err := io.ReadAll(or)
	if err != nil || string(rest) != gatedTail {
		t.Fatalf("owner's tail: %q %v", rest, err)
	}
	jrest, err := io.ReadAll(jr)
	if err != nil || string(jrest) != gatedTail {
		t.Fatalf("joiner's tail: %q, %v: a joiner passing a live stream on was cut by a PostgreSQL restart although the call completed", jrest, err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// A retry with the same key arrives after the owner's client got the end of its stream
// and before the record commits (held up by a row lock): on the owner's process and on
// another, it joins and gets the identical bytes once the record commits, with no
// second upstream call; the joining gauges go back to 0; a later retry is a replay.
func TestRetryBetweenTheEOFAndTheCommitJoins(t *testing.T) {
	t.Parallel()
	up := newGatedStream()
	fl := gatewaysOn(t, up, 2, gateway.Config{Ledger: ledger.Config{StreamFlushInterval: time.Hour}})
	const key = "retry-between-eof-and-commit"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, fl.urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 2); got != gatedHead {
		t.Fatalf("head: %q", got)
	}
	<-up.sent
	waitRow(t, fl.pool, row, "the stream's announcement", announced)
	release := holdRecord(t, fl.pool, row)
	close(up.release)
	if tail, err := readAllWithin(or, 15*time.Second); err != nil || tail != gatedTail {
		t.Fatalf("the owner's tail: %q %v", tail, err)
	}
	type answer struct {
		body string
		err  error
	}
	var answers [2]chan answer
	for i := range 2 {
		r := openStream(t, fl.urls[i], key)
		if r.StatusCode != http.StatusOK || r.Header.Get("Onceflow-Joined") != "true" {
			t.Fatalf("retry on gateway %d: %d %v, want a join", i, r.StatusCode, r.Header)
		}
		answers[i] = make(chan answer, 1)
		go func() {
			b, err := io.ReadAll(r.Body)
			answers[i] <- answer{string(b), err}
		}()
	}
	fl.waitJoining(t, 0, 1)
	fl.waitJoining(t, 1, 1)
	if r := waitRow(t, fl.pool, row, "row", func(*ledger.Row) bool { return true }); r.State != ledger.StateInFlight {
		t.Fatalf("the record was not held up: %s", r.State)
	}
	release()
	for i := range 2 {
		select {
		case a := <-answers[i]:
			if a.err != nil || a.body != gatedHead+gatedTail {
				t.Fatalf("retry on gateway %d: %q %v", i, a.body, a.err)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("retry on gateway %d did not end once the record committed", i)
		}
	}
	for i := range 2 {
		for deadline := time.Now().Add(10 * time.Second); gaugeOf(t, fl.regs[i], "onceflow_gateway_joining") != 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("gateway %d: onceflow_gateway_joining stays at %v", i, gaugeOf(t, fl.regs[i], "onceflow_gateway_joining"))
			}
		}
		if n := requestsWith(t, fl.regs[i], "joined"); n != 1 {
			t.Errorf("gateway %d: %v joined requests, want 1", i, n)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); requestsWith(t, fl.regs[0], "forwarded") != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the owner's call counted %v times as forwarded, want 1", requestsWith(t, fl.regs[0], "forwarded"))
		}
	}
	r, body, err := streamPost(t, fl.urls[0], key)
	if err != nil || body != gatedHead+gatedTail || r.Header.Get("Idempotent-Replayed") != "true" || r.Header.Get("Onceflow-Joined") != "" {
		t.Fatalf("a retry after the record: joined %q replayed %q %v", r.Header.Get("Onceflow-Joined"), r.Header.Get("Idempotent-Replayed"), err)
	}
	if n := up.Calls(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// A follower on another process passes a stream on from the row's partial output, from
// the offset it reached. PostgreSQL crashes (SIGKILL; an OOM kill of any backend does
// the same) right after a relaxed AppendPartial committed; the owner's pool replaces
// its dead connection on its next ping (a pause in the stream of over a second), so
// none of its writes fails and it appends on. The follower must still get the stream
// exactly as the owner's client does, or be cut, never other bytes.
func TestCrashLostPartialNeverFeedsAFollowerOtherBytes(t *testing.T) {
	t.Parallel()
	const (
		a    = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"
		b    = "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n"
		c    = "data: {\"choices\":[{\"delta\":{\"content\":\"c, which is longer than b is\"}}]}\n\n"
		done = "data: [DONE]\n\n"
	)
	up := newPhased(a, b, c, done)
	ups := httptest.NewServer(up)
	t.Cleanup(ups.Close)
	pg, dsn, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	ctx := context.Background()
	// Only a durable commit flushes the WAL within the test's window (as in the ledger's
	// crash tests).
	for _, sql := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET autovacuum = off`, `SELECT pg_reload_conf()`} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond)
	var urls []string
	for range 2 {
		gpool, err := connect.Postgres(ctx, dsn, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(gpool.Close)
		g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/v1", DB: gpool, Logger: testenv.Logger(t), Timeout: 30 * time.Second,
			Ledger: ledger.Config{Lease: time.Minute, StreamFlushInterval: 20 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		gs := httptest.NewServer(g)
		t.Cleanup(gs.Close)
		urls = append(urls, gs.URL+"/v1")
	}
	const key = "crash-lost-partial-0001"
	row := keyFor("Bearer sk", key)
	owner := openStream(t, urls[0], key)
	or := bufio.NewReader(owner.Body)
	if got := readEvents(t, or, 1); got != a {
		t.Fatalf("a: %q", got)
	}
	waitRow(t, pool, row, "a persisted", func(r *ledger.Row) bool { return r.Partial == a && r.Meta != nil })
	if _, err := pool.Exec(ctx, `CREATE TABLE durable_commit ()`); err != nil { // flushes the announcement and a
		t.Fatal(err)
	}
	follower := openStream(t, urls[1], key)
	fr := bufio.NewReader(follower.Body)
	if got := readEvents(t, fr, 1); got != a || follower.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("the follower's a: %q", got)
	}
	close(up.gates[0])
	if got := readEvents(t, or, 1); got != b {
		t.Fatalf("b: %q", got)
	}
	waitRow(t, pool, row, "b persisted", func(r *ledger.Row) bool { return r.Partial == a+b })
	if got := readEvents(t, fr, 1); got != b {
		t.Fatalf("the follower's b: %q", got)
	}
	pg.Kill()
	pg.Start()
	time.Sleep(1500 * time.Millisecond) // the model pauses; the pools ping their idle connections before the next use
	close(up.gates[1])
	if got := readEvents(t, or, 1); got != c {
		t.Fatalf("c: %q", got)
	}
	// Give the owner's persister time to write c (a correct one may refuse to).
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var p string
		if pool.QueryRow(ctx, `SELECT coalesce(partial, '') FROM llm_calls WHERE idem_key = $1`, row).Scan(&p) == nil && p != a && p != a+b {
			t.Logf("the row's partial after the crash and c: %q", p)
			break
		}
	}
	time.Sleep(500 * time.Millisecond) // the follower polls
	close(up.gates[2])
	if rest, err := readAllWithin(or, 15*time.Second); err != nil || rest != done {
		t.Fatalf("the owner's end: %q %v", rest, err)
	}
	rest, err := readAllWithin(fr, 15*time.Second)
	if rest != c+done && !(err != nil && strings.HasPrefix(c+done, rest)) {
		t.Fatalf("after a and b the follower got %q (err %v), want %q or a prefix of it and a cut: "+
			"the row's partial lost b to the crash and the owner appended c after a", rest, err, c+done)
	}
	if err != nil {
		t.Logf("the follower was cut after a correct prefix: %v", err)
	}
}

// A PostgreSQL restart of a second or two in the middle of a long stream: a request
// on another gateway process that joined the stream (it follows it through the row)
// must go on receiving the live tail once PostgreSQL is back, as docs/providers.md
// promises ("about 0.4 to 0.5 s behind the owner's client"), not only at the stream's
// end, which may be minutes later. One upstream call; both clients get every byte.
func TestPostgresBlipDoesNotStopTheLiveTailOfAJoinerOnAnotherProcess(t *testing.T) {
	t.Parallel()
	parts := []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"before\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\" during the outage\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\" after it\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\" end\"}}]}\n\ndata: [DONE]\n\n",
	}
	up := newPhased(parts...)
	pg, urls := privateFleet(t, up, gateway.Config{Timeout: 45 * time.Second, Ledger: ledger.Config{StreamFlushInterval: 100 * time.Millisecond}})
	const key = "blip-live-tail-0001"
	owner := bufio.NewReader(openStream(t, urls[0], key).Body)
	if got, err := readExactly(owner, len(parts[0]), 10*time.Second); err != nil || got != parts[0] {
		t.Fatalf("owner's head: %q %v", got, err)
	}
	<-up.sent
	jresp := openStream(t, urls[1], key)
	if jresp.Header.Get("Onceflow-Joined") != "true" {
		t.Fatalf("did not join: %d %v", jresp.StatusCode, jresp.Header)
	}
	joiner := collect(jresp.Body)
	if got := joiner.waitFor(parts[0], 10*time.Second); got != parts[0] {
		t.Fatalf("joiner's head: %q", got)
	}
	pg.Stop()
	close(up.gates[0]) // an event while PostgreSQL is down: the persister's write fails
	if got, err := readExactly(owner, len(parts[1]), 10*time.Second); err != nil || got != parts[1] {
		t.Fatalf("owner during the outage: %q %v", got, err)
	}
	time.Sleep(time.Second) // several flush ticks fail
	pg.Start()
	time.Sleep(time.Second)
	close(up.gates[1]) // the stream goes on after the outage
	if got, err := readExactly(owner, len(parts[2]), 10*time.Second); err != nil || got != parts[2] {
		t.Fatalf("owner after the outage: %q %v", got, err)
	}
	want := parts[0] + parts[1] + parts[2]
	got := joiner.waitFor(want, 5*time.Second)
	close(up.gates[2])
	if got != want {
		t.Errorf("the joiner on the other process had %q within 5 s of events sent after PostgreSQL came back, want %q: "+
			"its live tail stopped at the outage and resumes only at the stream's end", got, want)
	}
	if rest, err := readAllWithin(owner, 15*time.Second); err != nil || rest != parts[3] {
		t.Fatalf("owner's end: %q %v", rest, err)
	}
	if all, err := joiner.end(15 * time.Second); err != nil || all != up.whole() {
		t.Fatalf("joiner's whole stream: %q %v", all, err)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("%d upstream calls, want 1", n)
	}
}

// collector reads a body to its end in the background, keeping what it read.
type collector struct {
	mu   sync.Mutex
	b    strings.Builder
	err  error
	done chan struct{}
}

func collect(r io.Reader) *collector {
	c := &collector{done: make(chan struct{})}
	go func() {
		defer close(c.done)
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			c.mu.Lock()
			c.b.Write(buf[:n])
			if err != nil {
				if err != io.EOF {
					c.err = err
				}
				c.mu.Unlock()
				return
			}
			c.mu.Unlock()
		}
	}()
	return c
}

func (c *collector) text() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.b.String()
}

// waitFor waits up to d until what was read is want, and returns what was read.
func (c *collector) waitFor(want string, d time.Duration) string {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if got := c.text(); len(got) >= len(want) {
			return got
		}
	}
	return c.text()
}

// end waits up to d for the body's end and returns all of it.
func (c *collector) end(d time.Duration) (string, error) {
	select {
	case <-c.done:
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.b.String(), c.err
	case <-time.After(d):
		return c.text(), errors.New("not at its end in time")
	}
}

// An outage longer than the lease (ONCEFLOW_LEDGER_LEASE) while a keyed call is in
// flight and its owner alive: the owner cannot renew while PostgreSQL is down, so when
// it is back the row's lease has run out, and until the owner's next renewal (up to
// Lease/3 later) the row looks like a dead owner's. A client's retry in that window,
// on the other gateway (an SDK retrying the 503 it got during the outage after
// retry-after-ms), must join the live call, not take it over: one upstream call.
// (Lease 9 s here, renewed every 3 s; the retry is timed between two renewals.)
func TestRetryRightAfterAnOutageLongerThanTheLeaseJoinsTheLiveCall(t *testing.T) {
	testenv.Long(t) // an outage longer than the lease
	t.Parallel()
	up := newHeldUnary()
	const lease = 9 * time.Second
	pg, urls := privateFleet(t, up, gateway.Config{Timeout: 45 * time.Second, Ledger: ledger.Config{Lease: lease}})
	const key = "outage-past-the-lease-0001"
	first := make(chan reply, 1)
	go func() { first <- sendWithin(urls[0], key, chatBody, 50*time.Second) }()
	select {
	case <-up.received:
	case <-time.After(15 * time.Second):
		t.Fatal("the call never reached the upstream")
	}
	t0 := time.Now() // the attempt began about now: its renewals fall at t0 + k·lease/3
	time.Sleep(200 * time.Millisecond)
	pg.Stop()
	// Back just after the renewal at t0+12s (which failed): the lease ran out at t0+9s,
	// and the next renewal is at t0+15s.
	time.Sleep(time.Until(t0.Add(4*lease/3 + 100*time.Millisecond)))
	pg.Start()
	back := time.Since(t0)
	retry := make(chan reply, 1)
	go func() { retry <- sendWithin(urls[1], key, chatBody, 40*time.Second) }()
	// A retry that joins waits for the answer; one that took the call over has made a
	// second upstream call by now.
	time.Sleep(3 * time.Second)
	close(up.release)
	r := <-retry
	retried := time.Since(t0)
	r1 := <-first
	t.Logf("PostgreSQL back at t0+%v, the retry answered at t0+%v", back.Round(time.Millisecond), retried.Round(time.Millisecond))
	if back > 5*lease/3 {
		t.Skipf("PostgreSQL took too long to start (t0+%v): the owner's renewal came first", back)
	}
	if r1.err != nil || r1.code != http.StatusOK || r.err != nil || r.code != http.StatusOK || r.body != r1.body {
		t.Errorf("the first client: %d %q %v; the retry: %d %q %v; want one answer for both", r1.code, r1.body, r1.err, r.code, r.body, r.err)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("%d upstream calls, want 1: the retry after the outage took over a call whose owner was alive and still waiting for the upstream", n)
	}
}
