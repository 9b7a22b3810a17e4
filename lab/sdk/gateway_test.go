package sdk_test

// The gateway against clients nobody here wrote: the official OpenAI Node SDK (npm
// openai) and Anthropic TypeScript SDK (npm @anthropic-ai/sdk), pinned in
// testdata/sdk/package.json and installed by the test itself (lab/npmkit; node and
// npm come from `scripts/dev-services up`, ONCEFLOW_SKIP_NODE=1 skips), and openai-go.
// Each SDK keeps its own retry logic (maxRetries 2, its own backoff, its own reading of
// Retry-After and retry-after-ms) and its own timeout; the faults are a slow upstream
// (fake-llm's latency or drip) and a TCP proxy between the SDK and the gateway that
// cuts the first connection mid-answer. Whatever the fault, the SDK must end with the
// whole answer, the gateway must call the upstream once, no attempt may be answered
// 409 (a retry meeting the call in flight joins it), and the answer must be the one a
// later request with the same key gets replayed. Without an Idempotency-Key, with
// Config.DeriveKeys, the SDK's own retry after a cut must get the same.
//
// What the SDKs do, read off their code (and checked by these tests): their timeout
// covers the wait for the answer's headers (openai-go's covers the body too); the Node
// SDKs retry a timeout, a connection failure before the headers, 408, 409, 429 and 5xx,
// after retry-after-ms when the answer has it, else 0.5s, 1s (less up to 25% jitter);
// openai-go retries the same except its own per-attempt timeout, which ends the call;
// no SDK retries a stream cut after its headers: the application calls again, with the
// same Idempotency-Key. Every attempt carries X-Stainless-Retry-Count (0, 1, 2).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/lab/npmkit"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/sse"
)

// sdkDir holds the scripts and the pinned package.json and package-lock.json.
const sdkDir = "testdata/sdk"

// Timings. In the slow-upstream cases the SDK gives up on an attempt after sdkTimeout
// and retries 0.375-0.5s later, while the upstream takes sdkSlow to answer: the retry
// arrives while the first call is in flight and must get its answer before its own
// timeout, by 2*sdkTimeout + 0.375s. Under a gateway that answers such a retry 409 with
// retry-after-ms 1000, the SDK's next attempt would come after the call ended and get
// the replay: only the 409 in between tells the two apart, and the tests reject it.
// sdkPace paces a stream that a retry must meet live.
const (
	sdkTimeout = 2 * time.Second
	sdkSlow    = 3800 * time.Millisecond
	sdkPace    = 120 * time.Millisecond
	// sdkDrip is how long a dripped answer takes, nominally, and sdkDripTimeout the
	// SDK's timeout then. A drip wakes up once a byte, so on a loaded machine it takes
	// longer (447 bytes meant for 2.8s took over 7.4s beside a dozen other clients under
	// -race); the drip cases leave room for it: should the SDK's retry time out while it
	// waits joined, its last retry joins again, by 3*sdkDripTimeout + 1.3s.
	sdkDrip        = 5 * time.Second
	sdkDripTimeout = 4 * time.Second
	// sdkConcurrent bounds the calls the tests make at once: each client is a process
	// (node) that takes a few hundred ms of CPU to start, on two cores.
	sdkConcurrent = 10
)

// sdkSlots holds a place for each call in progress, of every test (sdkRun).
var sdkSlots = make(chan struct{}, sdkConcurrent)

// sdkProto is one protocol of one SDK.
type sdkProto struct {
	name   string // subtest name
	script string // under sdkDir
	api    string // chat, responses or messages (the script's input)
	path   string // on the gateway
	root   bool   // the SDK's baseURL is the gateway's root, not its /v1 (Anthropic's)
	params string // the request body, stream aside
}

var sdkProtos = []sdkProto{
	{"openai-chat", "openai.mjs", "chat", "/v1/chat/completions", false,
		`{"model":"gpt-4.1-mini","temperature":1,"messages":[{"role":"user","content":"Say one random word."}]}`},
	{"openai-responses", "openai.mjs", "responses", "/v1/responses", false,
		`{"model":"gpt-4.1-mini","temperature":1,"input":"Say one random word."}`},
	{"anthropic-messages", "anthropic.mjs", "messages", "/v1/messages", true,
		`{"model":"claude-haiku-4-5","max_tokens":256,"temperature":1,"messages":[{"role":"user","content":"Say one random word."}]}`},
}

// body is p's request body, streamed or not.
func (p sdkProto) body(stream bool) []byte {
	if !stream {
		return []byte(p.params)
	}
	return []byte(strings.Replace(p.params, "{", `{"stream":true,`, 1))
}

// sdkDripFor returns the DripInterval that makes fake-llm's plain answer to p last d:
// it answers a prompt with as many bytes every time (ids, timestamps and the sample
// tag are of fixed length).
func sdkDripFor(t *testing.T, p sdkProto, d time.Duration) time.Duration {
	t.Helper()
	fs, err := fakeserver.New(fakeserver.Config{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, p.path, bytes.NewReader(p.body(false)))
	req.Header.Set("Content-Type", "application/json")
	fs.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK || rec.Body.Len() == 0 {
		t.Fatalf("fake-llm answered %s %d: %s", p.path, rec.Code, rec.Body)
	}
	return d / time.Duration(rec.Body.Len())
}

// sdkCut says where the proxy cuts the first connection: sdkNoCut never, sdkCutStatus
// inside the status line of the answer (the client sees no answer: an SDK retries by
// itself), n > 0 after n whole events of a stream.
type sdkCut int

const (
	sdkNoCut     sdkCut = 0
	sdkCutStatus sdkCut = -1
)

// sdkProxy is a TCP proxy in front of the gateway. It passes both ways untouched, but
// for the first connection it accepts, whose answer it cuts where cut says: it passes
// the bytes before the cut, then resets the client's connection (RST) and closes the
// gateway's (which goes on with the upstream call, as it does for any client gone).
type sdkProxy struct {
	ln     net.Listener
	target string
	cut    sdkCut
	first  atomic.Bool
	cuts   atomic.Int32
	mu     sync.Mutex
	conns  []net.Conn
	wg     sync.WaitGroup
}

func sdkNewProxy(t *testing.T, target string, cut sdkCut) *sdkProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &sdkProxy{ln: ln, target: target, cut: cut}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *sdkProxy) url() string { return "http://" + p.ln.Addr().String() }

func (p *sdkProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		first := p.first.CompareAndSwap(false, true)
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.serve(c, first)
		}()
	}
}

func (p *sdkProxy) track(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns = append(p.conns, cs...)
}

func (p *sdkProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *sdkProxy) serve(client net.Conn, cut bool) {
	defer client.Close()
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer up.Close()
	p.track(client, up)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		_, _ = io.Copy(up, client)
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	if !cut {
		_, _ = io.Copy(client, up)
		return
	}
	var seen []byte
	buf := make([]byte, 32<<10)
	for {
		n, err := up.Read(buf)
		if n > 0 {
			passed := len(seen)
			seen = append(seen, buf[:n]...)
			if at := p.cutAt(seen); at >= 0 {
				_, _ = client.Write(seen[passed:max(at, passed)])
				if tc, ok := client.(*net.TCPConn); ok {
					_ = tc.SetLinger(0) // Close sends RST
				}
				p.cuts.Add(1)
				return
			}
			if _, werr := client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// cutAt returns where to cut an answer that began with seen, or -1 for not yet.
func (p *sdkProxy) cutAt(seen []byte) int {
	if p.cut == sdkCutStatus {
		return min(len(seen), len("HTTP/1.1 2"))
	}
	h := bytes.Index(seen, []byte("\r\n\r\n"))
	if h < 0 {
		return -1
	}
	// Events end with a blank line; the chunked framing ("\r\nSIZE\r\n") never makes
	// one, and a blank line split by it is only counted later.
	at := h + 4
	for range int(p.cut) {
		i := bytes.Index(seen[at:], []byte("\n\n"))
		if i < 0 {
			return -1
		}
		at += i + 2
	}
	return at
}

// sdkEnv is a gateway in front of fake-llm, maybe behind an sdkProxy.
type sdkEnv struct {
	fake  *fakeserver.Server
	gw    string // the gateway's root URL
	proxy *sdkProxy
	reg   *prometheus.Registry // the gateway's metrics
	// requests is the number of upstream requests once the case's call ended (sdkRun).
	requests int64
}

// sdkFaults are the faults of a case.
type sdkFaults struct {
	fake fakeserver.Config // fake-llm's (Latency, DripInterval)
	drip bool              // the first upstream answer drips, a byte every fake.DripInterval
	pace time.Duration     // the first upstream stream comes an event every pace
	cut  sdkCut            // the proxy in front of the gateway cuts the first connection
}

// sdkSetup starts fake-llm with the faults f, a gateway configured by cfg on db in front
// of it, and the proxy f asks for.
func sdkSetup(t *testing.T, db ledger.DB, f sdkFaults, cfg gateway.Config) *sdkEnv {
	t.Helper()
	f.fake.Logger = testenv.Logger(t)
	fs, err := fakeserver.New(f.fake)
	if err != nil {
		t.Fatal(err)
	}
	if f.drip {
		fs.Script(fakeserver.Fault{Kind: fakeserver.FaultDrip})
	}
	var up http.Handler = fs
	if f.pace > 0 {
		up = &sdkPaced{next: fs, pace: f.pace}
	}
	ups := httptest.NewServer(up)
	t.Cleanup(func() { fs.Close(); ups.Close() })
	reg := prometheus.NewRegistry()
	cfg.Upstream, cfg.DB, cfg.Logger, cfg.Registerer = ups.URL+"/v1", db, testenv.Logger(t), reg
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	e := &sdkEnv{fake: fs, gw: gs.URL, reg: reg}
	if f.cut != sdkNoCut {
		e.proxy = sdkNewProxy(t, strings.TrimPrefix(gs.URL, "http://"), f.cut)
	}
	return e
}

// sdkPaced passes requests to next, but its first answer, when it is a stream, comes an
// event every pace (fake-llm writes one event at a time), as a model's tokens do.
type sdkPaced struct {
	next  http.Handler
	pace  time.Duration
	calls atomic.Int32
}

func (u *sdkPaced) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if u.calls.Add(1) == 1 {
		w = &sdkPacedWriter{ResponseWriter: w, pace: u.pace, done: r.Context().Done()}
	}
	u.next.ServeHTTP(w, r)
}

type sdkPacedWriter struct {
	http.ResponseWriter
	pace   time.Duration
	done   <-chan struct{}
	writes int
}

func (w *sdkPacedWriter) Write(b []byte) (int, error) {
	if w.writes > 0 && strings.HasPrefix(w.Header().Get("Content-Type"), "text/event-stream") {
		select {
		case <-time.After(w.pace):
		case <-w.done:
			return 0, http.ErrAbortHandler
		}
	}
	w.writes++
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach Flush.
func (w *sdkPacedWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// root is where clients call: the proxy, else the gateway.
func (e *sdkEnv) root() string {
	if e.proxy != nil {
		return e.proxy.url()
	}
	return e.gw
}

// baseURL is p's SDK's baseURL.
func (e *sdkEnv) baseURL(p sdkProto) string {
	if p.root {
		return e.root()
	}
	return e.root() + "/v1"
}

// sdkInput is the input of the scripts (testdata/sdk/lib.mjs).
type sdkInput struct {
	BaseURL        string          `json:"baseURL"`
	APIKey         string          `json:"apiKey"`
	IdempotencyKey string          `json:"idempotencyKey,omitempty"`
	API            string          `json:"api"`
	Stream         bool            `json:"stream"`
	Params         json.RawMessage `json:"params"`
	TimeoutMs      int64           `json:"timeoutMs"`
	MaxRetries     int             `json:"maxRetries"`
	AppRetries     int             `json:"appRetries"`
	Replay         bool            `json:"replay"`
}

// sdkAttempt is one HTTP attempt an SDK made.
type sdkAttempt struct {
	RetryCount     string `json:"retryCount"` // X-Stainless-Retry-Count
	IdempotencyKey string `json:"idempotencyKey"`
	Status         int    `json:"status"` // 0: no answer (Error)
	Replayed       string `json:"replayed"`
	Error          string `json:"error"`
	AtMs           int64  `json:"atMs"`      // sent, in ms since the client started
	EndMs          int64  `json:"headersMs"` // answered (its headers) or failed
}

// sdkCall is one call the application made (the SDK's attempts within).
type sdkCall struct {
	OK      bool   `json:"ok"`
	Error   string `json:"error"`
	Status  int    `json:"status"`
	StartMs int64  `json:"startedMs"`
	EndMs   int64  `json:"endedMs"`
}

// sdkOutput is what a client got: the scripts' output, or the same from openai-go.
type sdkOutput struct {
	OK        bool              `json:"ok"`
	Calls     []sdkCall         `json:"calls"`
	Attempts  []sdkAttempt      `json:"attempts"`
	Result    json.RawMessage   `json:"result"` // the answer of a plain call, as the SDK parsed it
	Events    []json.RawMessage `json:"events"` // the events of a stream the SDK yielded
	Replay    *sdkReplayed      `json:"replay"`
	ElapsedMs int64             `json:"elapsedMs"`
}

// sdkReplayed is the answer to the same request sent again later.
type sdkReplayed struct {
	Status   int    `json:"status"`
	Replayed string `json:"replayed"` // the Idempotent-Replayed header
	Body     string `json:"body"`
	Error    string `json:"error"`
}

func (o sdkOutput) String() string {
	b, _ := json.Marshal(struct {
		OK        bool
		Calls     []sdkCall
		Attempts  []sdkAttempt
		Events    int
		ElapsedMs int64
	}{o.OK, o.Calls, o.Attempts, len(o.Events), o.ElapsedMs})
	return string(b)
}

// sdkNodeCall returns the call that runs script, from the folder of scripts (npmkit
// Modules.Scripts), with in, the gateway's URL filled in by e.
func sdkNodeCall(mods *npmkit.Modules, folder, script string, p sdkProto, in sdkInput) func(ctx context.Context, e *sdkEnv) (sdkOutput, error) {
	return func(ctx context.Context, e *sdkEnv) (sdkOutput, error) {
		in.BaseURL = e.baseURL(p)
		arg, err := json.Marshal(in)
		if err != nil {
			return sdkOutput{}, err
		}
		cmd := mods.Command(ctx, folder, script, string(arg))
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return sdkOutput{}, fmt.Errorf("node %s: %w\nstderr:\n%s\nstdout:\n%s", script, err, stderr.String(), stdout.String())
		}
		var out sdkOutput
		if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
			return sdkOutput{}, fmt.Errorf("node %s printed no result: %w\nstderr:\n%s\nstdout:\n%s", script, err, stderr.String(), stdout.String())
		}
		return out, nil
	}
}

// sdkCase is one client's call under one fault.
type sdkCase struct {
	name   string
	proto  sdkProto
	stream bool
	faults sdkFaults
	gw     gateway.Config
	// call makes the client's call through e; it runs in a goroutine, beside the
	// calls of the other cases, and reports its failures as errors.
	call func(ctx context.Context, e *sdkEnv) (sdkOutput, error)
	// again makes the call a second time once the first ended, and passes its output
	// to check.
	again bool
	// check asserts what the case wants besides sdkCheck's; nil for nothing more.
	check func(t *testing.T, e *sdkEnv, out, again sdkOutput)
}

// sdkRun sets every case up (one schema for all: the cases' keys and credentials
// differ), makes their calls together (sdkConcurrent at most), then checks each in a
// subtest. The calls mostly wait (timeouts, backoffs, a slow upstream), so running
// them together keeps the test short whatever go test's -parallel (GOMAXPROCS, 2 on CI).
// A -run pattern that picks one case still makes every call.
func sdkRun(t *testing.T, cases []sdkCase) {
	t.Helper()
	start := time.Now()
	pool, _ := testenv.Postgres(t)
	type run struct {
		e          *sdkEnv
		out, again sdkOutput
		err        error
	}
	runs := make([]run, len(cases))
	for i, c := range cases {
		runs[i].e = sdkSetup(t, pool, c.faults, c.gw)
	}
	setUp := time.Since(start)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for i, c := range cases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sdkSlots <- struct{}{}
			defer func() { <-sdkSlots }()
			r := &runs[i]
			r.out, r.err = c.call(ctx, r.e)
			r.e.requests = r.e.fake.Stats().Requests
			if c.again && r.err == nil {
				r.again, r.err = c.call(ctx, r.e)
			}
		}()
	}
	wg.Wait()
	t.Logf("%d cases set up in %v, their calls made in %v", len(cases), setUp.Round(time.Millisecond), (time.Since(start) - setUp).Round(time.Millisecond))
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := runs[i]
			if r.err != nil {
				t.Fatal(r.err)
			}
			t.Logf("gateway results: %v", sdkResults(t, r.e.reg))
			sdkCheck(t, r.e, c.proto, c.stream, r.out)
			if c.check != nil {
				c.check(t, r.e, r.out, r.again)
			}
		})
	}
}

// sdkResults returns the gateway's requests by result (onceflow_gateway_requests_total):
// forwarded, joined, replayed...
func sdkResults(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "onceflow_gateway_requests_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if v := m.GetCounter().GetValue(); v > 0 {
				out[m.GetLabel()[0].GetValue()] = v
			}
		}
	}
	return out
}

// sdkAnswer is the text of an answer and how it ended.
type sdkAnswer struct {
	text  string
	final string // the finish reason, status or last event that says the answer is whole
}

// sdkUnary reads the text and finish of a plain answer of api.
func sdkUnary(t *testing.T, api string, raw []byte) sdkAnswer {
	t.Helper()
	var a sdkAnswer
	switch api {
	case "chat":
		var c struct {
			Choices []struct {
				Message      struct{ Content string }
				FinishReason string `json:"finish_reason"`
			}
		}
		if err := json.Unmarshal(raw, &c); err != nil || len(c.Choices) == 0 {
			t.Fatalf("not a chat completion (%v): %s", err, raw)
		}
		a = sdkAnswer{c.Choices[0].Message.Content, c.Choices[0].FinishReason}
	case "responses":
		var r struct {
			Status string
			Output []struct {
				Type    string
				Content []struct{ Type, Text string }
			}
		}
		if err := json.Unmarshal(raw, &r); err != nil {
			t.Fatalf("not a response (%v): %s", err, raw)
		}
		for _, o := range r.Output {
			for _, c := range o.Content {
				if c.Type == "output_text" {
					a.text += c.Text
				}
			}
		}
		a.final = r.Status
	case "messages":
		var m struct {
			Content    []struct{ Type, Text string }
			StopReason string `json:"stop_reason"`
		}
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatalf("not a message (%v): %s", err, raw)
		}
		for _, c := range m.Content {
			if c.Type == "text" {
				a.text += c.Text
			}
		}
		a.final = m.StopReason
	}
	return a
}

// sdkStreamed assembles the text of the events of a stream of api (the data of each, as
// an SDK yields them) and names its end: the finish reason of Chat Completions (whose
// [DONE] the SDKs do not yield), else the type of the last event.
func sdkStreamed(t *testing.T, api string, events []json.RawMessage) sdkAnswer {
	t.Helper()
	var a sdkAnswer
	for _, ev := range events {
		var d struct {
			Type    string
			Delta   json.RawMessage
			Choices []struct {
				Delta        struct{ Content string }
				FinishReason string `json:"finish_reason"`
			}
		}
		if err := json.Unmarshal(ev, &d); err != nil {
			t.Fatalf("event %s: %v", ev, err)
		}
		switch api {
		case "chat":
			for _, c := range d.Choices {
				a.text += c.Delta.Content
				if c.FinishReason != "" {
					a.final = c.FinishReason
				}
			}
		case "responses":
			if d.Type == "response.output_text.delta" {
				var s string
				_ = json.Unmarshal(d.Delta, &s)
				a.text += s
			}
			a.final = d.Type
		case "messages":
			if d.Type == "content_block_delta" {
				var td struct{ Type, Text string }
				_ = json.Unmarshal(d.Delta, &td)
				if td.Type == "text_delta" {
					a.text += td.Text
				}
			}
			a.final = d.Type
		}
	}
	return a
}

// sdkAnswerOf reads the answer the client got in out.
func sdkAnswerOf(t *testing.T, p sdkProto, stream bool, out sdkOutput) sdkAnswer {
	t.Helper()
	if stream {
		return sdkStreamed(t, p.api, out.Events)
	}
	return sdkUnary(t, p.api, out.Result)
}

// sdkWantFinal is the end of a whole answer of api: plain, then streamed.
var sdkWantFinal = map[string][2]string{
	"chat":      {"stop", "stop"},
	"responses": {"completed", "response.completed"},
	"messages":  {"end_turn", "message_stop"},
}

// sdkRawEvents parses a raw event stream into the data an SDK yields: without pings and
// without Chat Completions' [DONE], which must be last when present (done).
func sdkRawEvents(t *testing.T, body string) (events []json.RawMessage, done bool) {
	t.Helper()
	var p sse.Parser
	all := append(p.Feed([]byte(body)), p.Close()...)
	for i, ev := range all {
		switch {
		case ev.Type == "ping":
		case strings.TrimSpace(ev.Data) == "[DONE]":
			if i != len(all)-1 {
				t.Fatalf("[DONE] is event %d of %d", i+1, len(all))
			}
			done = true
		default:
			events = append(events, json.RawMessage(ev.Data))
		}
	}
	return events, done
}

// sdkSameJSON reports whether a and b hold the same JSON value; drop names members of
// a's top-level object to ignore (what an SDK adds to an answer: output_text).
func sdkSameJSON(a, b []byte, drop ...string) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	if m, ok := x.(map[string]any); ok {
		for _, k := range drop {
			delete(m, k)
		}
	}
	return reflect.DeepEqual(x, y)
}

// sdkCheck asserts what every case wants of out, a call of p through e: it ended with
// the whole answer, no attempt was answered 409, the upstream was called once, and the
// answer is the later replay (when out has one). It returns the answer.
func sdkCheck(t *testing.T, e *sdkEnv, p sdkProto, stream bool, out sdkOutput) sdkAnswer {
	t.Helper()
	t.Logf("the client's calls and attempts:\n%v", out)
	if !out.OK {
		t.Fatalf("the SDK did not get the answer:\n%v", out)
	}
	for i, a := range out.Attempts {
		if a.Status == http.StatusConflict {
			t.Errorf("attempt %d (X-Stainless-Retry-Count %s, at %dms) was answered 409: a retry that meets the call in flight should join it and get its answer\n%v",
				i+1, a.RetryCount, a.AtMs, out)
		}
	}
	got := sdkAnswerOf(t, p, stream, out)
	want := sdkWantFinal[p.api][0]
	if stream {
		want = sdkWantFinal[p.api][1]
	}
	if got.text == "" || got.final != want {
		t.Errorf("the SDK's answer is not whole: text %q, ending %q (want %q)", got.text, got.final, want)
	}
	if n := e.requests; n != 1 {
		t.Errorf("the upstream was called %d times, want 1\n%v", n, out)
	}
	if out.Replay == nil {
		return got
	}
	r := out.Replay
	if r.Error != "" || r.Status != http.StatusOK || r.Replayed != "true" {
		t.Fatalf("the later request with the same key: %d, Idempotent-Replayed %q, %s; want the recorded answer", r.Status, r.Replayed, r.Error)
	}
	if !stream {
		if !sdkSameJSON(out.Result, []byte(r.Body), "output_text") {
			t.Errorf("the SDK's answer is not the replay's:\nSDK:    %s\nreplay: %s", out.Result, r.Body)
		}
		return got
	}
	events, done := sdkRawEvents(t, r.Body)
	if p.api == "chat" && !done {
		t.Errorf("the replayed stream does not end with [DONE]:\n%s", r.Body)
	}
	if len(events) != len(out.Events) {
		t.Fatalf("the SDK got %d events, the replay has %d:\n%s", len(out.Events), len(events), r.Body)
	}
	for i := range events {
		if !sdkSameJSON(out.Events[i], events[i]) {
			t.Errorf("event %d: the SDK got %s, the replay has %s", i+1, out.Events[i], events[i])
		}
	}
	if rt := sdkStreamed(t, p.api, events); rt != got {
		t.Errorf("the SDK assembled %+v, the replay %+v", got, rt)
	}
	return got
}

// sdkName is a subtest's name.
func sdkName(p sdkProto, stream bool) string {
	if stream {
		return p.name + "/stream"
	}
	return p.name + "/plain"
}

// sdkSlowFaults make the upstream wait sdkSlow before it answers (a stream's headers
// come then too: the SDKs' timeout covers only the wait for them).
func sdkSlowFaults() sdkFaults { return sdkFaults{fake: fakeserver.Config{Latency: sdkSlow}} }

// sdkDripFaults make the upstream drip its plain answer to p over sdkDrip, nominally
// (the gateway answers once the upstream's answer is whole, so the SDK waits for the
// headers all along; a dripped stream's headers would come at once).
func sdkDripFaults(t *testing.T, p sdkProto) sdkFaults {
	t.Helper()
	return sdkFaults{fake: fakeserver.Config{DripInterval: sdkDripFor(t, p, sdkDrip)}, drip: true}
}

// sdkCutFaults make the proxy cut the first connection: a plain answer inside its
// status line, a stream after two events while the upstream paces it (the retry meets
// it live).
func sdkCutFaults(stream bool) sdkFaults {
	if stream {
		return sdkFaults{pace: sdkPace, cut: 2}
	}
	return sdkFaults{cut: sdkCutStatus}
}

// sdkGoRecorder records the attempts of openai-go (option.WithMiddleware) and the body of
// the first, for the replay.
type sdkGoRecorder struct {
	mu       sync.Mutex
	start    time.Time
	attempts []sdkAttempt
	body     []byte
}

func (r *sdkGoRecorder) middleware(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
	a := sdkAttempt{RetryCount: req.Header.Get("X-Stainless-Retry-Count"), IdempotencyKey: req.Header.Get("Idempotency-Key"),
		AtMs: time.Since(r.start).Milliseconds()}
	r.mu.Lock()
	if r.body == nil && req.GetBody != nil {
		if b, err := req.GetBody(); err == nil {
			r.body, _ = io.ReadAll(b)
		}
	}
	r.mu.Unlock()
	res, err := next(req)
	a.EndMs = time.Since(r.start).Milliseconds()
	if err != nil {
		a.Error = err.Error()
	} else {
		a.Status, a.Replayed = res.StatusCode, res.Header.Get("Idempotent-Replayed")
	}
	r.mu.Lock()
	r.attempts = append(r.attempts, a)
	r.mu.Unlock()
	return res, err
}

// sdkGoCall makes one call of openai-go's Chat Completions, plain or streamed, and
// returns what it got as an sdkOutput.
func sdkGoCall(ctx context.Context, client oai.Client, stream bool, opts ...option.RequestOption) (result json.RawMessage, events []json.RawMessage, err error) {
	params := oai.ChatCompletionNewParams{Model: "gpt-4.1-mini", Temperature: oai.Float(1),
		Messages: []oai.ChatCompletionMessageParamUnion{oai.UserMessage("Say one random word.")}}
	if !stream {
		c, err := client.Chat.Completions.New(ctx, params, opts...)
		if err != nil {
			return nil, nil, err
		}
		return json.RawMessage(c.RawJSON()), nil, nil
	}
	s := client.Chat.Completions.NewStreaming(ctx, params, opts...)
	defer s.Close()
	for s.Next() {
		events = append(events, json.RawMessage(s.Current().RawJSON()))
	}
	return nil, events, s.Err()
}

// sdkGoCase is openai-go's call of Chat Completions with key ("" for none) and apiKey,
// each attempt bounded by timeout; after an error the application calls again with the
// same key, appRetries times at most, each time waiting twice as long. Its output is as
// the scripts' (sdkOutput), the replay asked raw with the SDK's own request body.
func sdkGoCase(stream bool, key, apiKey string, timeout time.Duration, appRetries int) func(ctx context.Context, e *sdkEnv) (sdkOutput, error) {
	return func(ctx context.Context, e *sdkEnv) (sdkOutput, error) {
		rec := &sdkGoRecorder{start: time.Now()}
		client := oai.NewClient(option.WithBaseURL(e.baseURL(sdkProtos[0])), option.WithAPIKey(apiKey), option.WithMaxRetries(2),
			option.WithMiddleware(rec.middleware))
		opts := []option.RequestOption{option.WithRequestTimeout(timeout)}
		if key != "" {
			opts = append(opts, option.WithHeader("Idempotency-Key", key))
		}
		var out sdkOutput
		for range appRetries + 1 {
			start := time.Since(rec.start).Milliseconds()
			result, events, err := sdkGoCall(ctx, client, stream, opts...)
			call := sdkCall{OK: err == nil, StartMs: start, EndMs: time.Since(rec.start).Milliseconds()}
			if err != nil {
				call.Error = err.Error()
			}
			out.Calls = append(out.Calls, call)
			if err == nil {
				out.OK, out.Result, out.Events = true, result, events
				break
			}
			timeout *= 2
			opts[0] = option.WithRequestTimeout(timeout)
		}
		rec.mu.Lock()
		out.Attempts, out.ElapsedMs = rec.attempts, time.Since(rec.start).Milliseconds()
		body := rec.body
		rec.mu.Unlock()
		if out.OK && key != "" {
			r, err := sdkReplay(ctx, e.gw+sdkProtos[0].path, key, "Bearer "+apiKey, body)
			if err != nil {
				return out, err
			}
			out.Replay = r
		}
		return out, nil
	}
}

// sdkReplay sends body again to url with key and auth (Authorization), raw.
func sdkReplay(ctx context.Context, url, key, auth string, body []byte) (*sdkReplayed, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", auth)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("replay: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("replay: %w", err)
	}
	return &sdkReplayed{Status: resp.StatusCode, Replayed: resp.Header.Get("Idempotent-Replayed"), Body: string(b)}, nil
}

// The official SDKs through the gateway, each fault against each SDK and protocol,
// plain and streamed; every case wants what sdkCheck asserts, and each kind of fault
// more:
//
//   - timeout (a): the upstream is slow (sdkSlowFaults); the SDK's timeout fires, and
//     its retry, with the same key, arrives while the first call is in flight: it must
//     join it. openai-go ends a call when its own per-attempt timeout fires (it retries
//     connection failures and statuses, not that), so there the application calls again
//     with the same key, at once, waiting twice as long.
//   - drip (a): the same with a plain answer that drips (sdkDripFaults), byte by byte.
//   - dropped (b): the connection between the SDK and the gateway breaks mid-answer,
//     the first time only (sdkCutFaults). A plain answer is cut inside its status line:
//     the SDK retries by itself and gets the replay. A stream is cut after two events
//     while the upstream is still producing it: the SDK throws, the application calls
//     again with the same key, and that call must join the live stream (the events so
//     far, then the rest).
//
// Node's cases run the scripts of testdata/sdk; openai-go's (c) are Chat Completions.
func TestSDKRetriesThroughTheGatewayGetOneWholeAnswer(t *testing.T) {
	t.Parallel()
	mods := npmkit.Install(t, sdkDir)
	folder := mods.Scripts(t, sdkDir)
	var cases []sdkCase
	node := func(fault string, p sdkProto, stream bool, f sdkFaults, timeout time.Duration, appRetries int, check func(t *testing.T, e *sdkEnv, out, _ sdkOutput)) {
		key := "sdk-node-" + fault + "-" + sdkName(p, stream)
		cases = append(cases, sdkCase{name: "node/" + fault + "/" + sdkName(p, stream), proto: p, stream: stream, faults: f,
			call: sdkNodeCall(mods, folder, p.script, p, sdkInput{APIKey: "sk-" + key, IdempotencyKey: key, API: p.api, Stream: stream,
				Params: json.RawMessage(p.params), TimeoutMs: timeout.Milliseconds(), MaxRetries: 2, AppRetries: appRetries, Replay: true}),
			check: check})
	}
	for _, p := range sdkProtos {
		for _, stream := range []bool{false, true} {
			node("timeout", p, stream, sdkSlowFaults(), sdkTimeout, 0, sdkTimedOutCheck)
			node("dropped", p, stream, sdkCutFaults(stream), 20*time.Second, 1, sdkDroppedCheck(stream))
		}
		if p.api != "responses" { // its 1 KB answer drips for too long on a loaded machine
			node("drip", p, false, sdkDripFaults(t, p), sdkDripTimeout, 0, sdkTimedOutCheck)
		}
	}
	chat := sdkProtos[0]
	goCase := func(fault string, stream bool, f sdkFaults, timeout time.Duration, appRetries int, check func(t *testing.T, e *sdkEnv, out, _ sdkOutput)) {
		key := "sdk-go-" + fault + "-" + sdkName(chat, stream)
		cases = append(cases, sdkCase{name: "go/" + fault + "/" + sdkName(chat, stream), proto: chat, stream: stream, faults: f,
			call: sdkGoCase(stream, key, "sk-"+key, timeout, appRetries), check: check})
	}
	goTimedOut := func(t *testing.T, e *sdkEnv, out, _ sdkOutput) {
		if len(out.Calls) != 2 || !strings.Contains(out.Calls[0].Error, "deadline exceeded") {
			t.Errorf("want the first call to time out and the application's second to succeed:\n%v", out)
		}
	}
	goCase("timeout", false, sdkSlowFaults(), sdkTimeout, 1, goTimedOut)
	goCase("timeout", true, sdkSlowFaults(), sdkTimeout, 1, goTimedOut)
	goCase("drip", false, sdkDripFaults(t, chat), sdkDripTimeout, 1, goTimedOut)
	goCase("dropped", false, sdkCutFaults(false), 20*time.Second, 0, sdkDroppedCheck(false)) // openai-go retries a cut before the headers
	goCase("dropped", true, sdkCutFaults(true), 20*time.Second, 1, sdkDroppedCheck(true))
	sdkRun(t, cases)
}

// sdkTimedOutCheck asserts that the SDK's first attempt timed out and that all carried
// the case's key.
func sdkTimedOutCheck(t *testing.T, e *sdkEnv, out, _ sdkOutput) {
	t.Helper()
	if len(out.Attempts) < 2 || out.Attempts[0].Status != 0 || !strings.Contains(strings.ToLower(out.Attempts[0].Error), "abort") {
		t.Errorf("the SDK's first attempt did not time out:\n%v", out)
	}
	for _, a := range out.Attempts {
		if a.IdempotencyKey != out.Attempts[0].IdempotencyKey || a.IdempotencyKey == "" {
			t.Errorf("the attempts carried Idempotency-Keys %q and %q", out.Attempts[0].IdempotencyKey, a.IdempotencyKey)
		}
	}
}

// sdkDroppedCheck asserts how the client got over a cut connection: a plain call by the
// SDK's own retry (X-Stainless-Retry-Count 1), a stream by the application's second
// call.
func sdkDroppedCheck(stream bool) func(t *testing.T, e *sdkEnv, out, again sdkOutput) {
	return func(t *testing.T, e *sdkEnv, out, _ sdkOutput) {
		t.Helper()
		if n := e.proxy.cuts.Load(); n != 1 {
			t.Errorf("the proxy cut %d connections, want 1", n)
		}
		if !stream && (len(out.Calls) != 1 || len(out.Attempts) != 2 || out.Attempts[1].RetryCount != "1") {
			t.Errorf("want the SDK's own retry (X-Stainless-Retry-Count 1) in one call:\n%v", out)
		}
		if stream && (len(out.Calls) != 2 || out.Calls[0].OK) {
			t.Errorf("want the cut stream to fail the first call and the application's second to succeed:\n%v", out)
		}
	}
}

// (d) Config.DeriveKeys = DeriveRetryCount, and no Idempotency-Key: an SDK's automatic
// retry (X-Stainless-Retry-Count: 1) after its connection broke before the answer's
// headers (the proxy cuts the first connection inside the status line) is answered from
// the identical earlier request of the same credentials: the replay of a plain answer,
// or the live tail of a stream the upstream still paces. One upstream call; the same
// call made afresh afterwards (X-Stainless-Retry-Count: 0) is a new one.
func TestSDKDerivedKeysMakeTheSDKsOwnRetriesIdempotent(t *testing.T) {
	t.Parallel()
	mods := npmkit.Install(t, sdkDir)
	folder := mods.Scripts(t, sdkDir)
	gw := gateway.Config{DeriveKeys: gateway.DeriveRetryCount}
	faults := func(stream bool) sdkFaults {
		if stream {
			return sdkFaults{cut: sdkCutStatus, pace: sdkPace}
		}
		return sdkFaults{cut: sdkCutStatus}
	}
	var cases []sdkCase
	for _, p := range sdkProtos {
		for _, stream := range []bool{false, true} {
			in := sdkInput{APIKey: "sk-derive-node-" + sdkName(p, stream), API: p.api, Stream: stream, Params: json.RawMessage(p.params),
				TimeoutMs: 20000, MaxRetries: 2}
			cases = append(cases, sdkCase{name: "node/" + sdkName(p, stream), proto: p, stream: stream, faults: faults(stream), gw: gw,
				call: sdkNodeCall(mods, folder, p.script, p, in), again: true, check: sdkDerivedCheck(p, stream)})
		}
	}
	chat := sdkProtos[0]
	for _, stream := range []bool{false, true} {
		cases = append(cases, sdkCase{name: "go/" + sdkName(chat, stream), proto: chat, stream: stream, faults: faults(stream), gw: gw,
			call: sdkGoCase(stream, "", "sk-derive-go-"+sdkName(chat, stream), 20*time.Second, 0), again: true,
			check: sdkDerivedCheck(chat, stream)})
	}
	sdkRun(t, cases)
}

// sdkDerivedCheck asserts that out, a keyless call whose first attempt was cut, got the
// whole answer through the SDK's own retry (sdkCheck counted one upstream call), and
// that again, the same call made afresh, was a new call with an answer of its own.
func sdkDerivedCheck(p sdkProto, stream bool) func(t *testing.T, e *sdkEnv, out, again sdkOutput) {
	return func(t *testing.T, e *sdkEnv, out, again sdkOutput) {
		t.Helper()
		if n := e.proxy.cuts.Load(); n != 1 {
			t.Fatalf("the proxy cut %d connections, want 1", n)
		}
		a := out.Attempts
		if len(out.Calls) != 1 || len(a) != 2 || a[0].Status != 0 || a[0].RetryCount != "0" || a[1].RetryCount != "1" || a[1].Status != 200 {
			t.Fatalf("want one call: a cut attempt (X-Stainless-Retry-Count 0), then the SDK's retry (1) answered 200:\n%v", out)
		}
		for _, at := range a {
			if at.IdempotencyKey != "" {
				t.Fatalf("the SDK sent an Idempotency-Key of its own: %q", at.IdempotencyKey)
			}
		}
		if !again.OK || len(again.Attempts) != 1 || again.Attempts[0].RetryCount != "0" {
			t.Fatalf("the same call afresh:\n%v", again)
		}
		if n := e.fake.Stats().Requests; n != 2 {
			t.Errorf("with the same call afresh (X-Stainless-Retry-Count 0) the upstream was called %d times in all, want 2 (a new call)", n)
		}
		first, second := sdkAnswerOf(t, p, stream, out), sdkAnswerOf(t, p, stream, again)
		if first.text == second.text {
			t.Errorf("the same call afresh got the first call's answer %q: a new call samples anew (temperature 1)", first.text)
		}
	}
}
