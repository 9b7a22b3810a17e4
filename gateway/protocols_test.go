package gateway_test

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// protocol is one of the APIs the gateway records: its path, a request body and the
// credential header its SDKs send.
type protocol struct {
	name, path, body string
	cred             func(h http.Header, secret string)
}

var protocols = []protocol{
	{"chat completions", "/chat/completions", `{"model":"gpt-4.1-mini","temperature":1,"messages":[{"role":"user","content":"Say one random word."}]%s}`,
		func(h http.Header, s string) { h.Set("Authorization", "Bearer "+s) }},
	{"responses", "/responses", `{"model":"gpt-4.1-mini","temperature":1,"input":"Say one random word."%s}`,
		func(h http.Header, s string) { h.Set("Authorization", "Bearer "+s) }},
	{"anthropic messages", "/messages", `{"model":"claude-sonnet-4-0","max_tokens":64,"temperature":1,"messages":[{"role":"user","content":"Say one random word."}]%s}`,
		func(h http.Header, s string) { h.Set("X-Api-Key", s); h.Set("Anthropic-Version", "2023-06-01") }},
}

type protoAnswer struct {
	status         int
	joined, replay string
	contentType    string
	body           []byte
	err            error
}

// protoPost sends p's body with Idempotency-Key key and secret in p's credential header.
func protoPost(url string, p protocol, stream bool, key, secret string) protoAnswer {
	return protoSend(url, p, stream, secret, http.Header{"Idempotency-Key": {key}})
}

// protoSend sends p's body (streaming or not) with secret in p's credential header (""
// for none) and the headers h.
func protoSend(url string, p protocol, stream bool, secret string, h http.Header) protoAnswer {
	extra := ""
	if stream {
		extra = `,"stream":true`
	}
	req, _ := http.NewRequest(http.MethodPost, url+p.path, strings.NewReader(strings.Replace(p.body, "%s", extra, 1)))
	req.Header.Set("Content-Type", "application/json")
	if secret != "" {
		p.cred(req.Header, secret)
	}
	for k, vs := range h {
		req.Header[k] = vs
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return protoAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return protoAnswer{resp.StatusCode, resp.Header.Get("Onceflow-Joined"), resp.Header.Get("Idempotent-Replayed"),
		resp.Header.Get("Content-Type"), b, err}
}

// Every recorded protocol (OpenAI Chat Completions and Responses, Anthropic Messages),
// unary and streaming: requests that arrive while the call runs, on its process and on
// another, join it; later ones replay it; all get the first answer byte for byte, from
// one upstream call. The same key under another credential is another call.
func TestEveryProtocolJoinsAndReplays(t *testing.T) {
	t.Parallel()
	for _, p := range protocols {
		for _, stream := range []bool{false, true} {
			name := p.name + "/unary"
			if stream {
				name = p.name + "/stream"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				fs, err := fakeserver.New(fakeserver.Config{Latency: 700 * time.Millisecond, Logger: testenv.Logger(t)})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(fs.Close)
				fl := gatewaysOn(t, fs, 2, gateway.Config{})
				key := "protocol-key-" + strings.NewReplacer(" ", "-", "/", "-").Replace(name)
				firstc := make(chan protoAnswer, 1)
				go func() { firstc <- protoPost(fl.urls[0], p, stream, key, "secret-a") }()
				waitUpstreamInFlight(t, fs)
				joined := make([]protoAnswer, 4)
				var wg sync.WaitGroup
				for i := range joined {
					wg.Go(func() { joined[i] = protoPost(fl.urls[i%2], p, stream, key, "secret-a") })
				}
				wg.Wait()
				first := <-firstc
				if first.err != nil || first.status != 200 || len(first.body) == 0 {
					t.Fatalf("first: %+v", first)
				}
				if stream != strings.HasPrefix(first.contentType, "text/event-stream") {
					t.Fatalf("first: Content-Type %q", first.contentType)
				}
				for i, j := range joined {
					if j.err != nil || j.status != 200 || j.joined != "true" || j.replay != "true" || !bytes.Equal(j.body, first.body) || j.contentType != first.contentType {
						t.Fatalf("joiner %d (gateway %d): %d joined=%q err=%v %q; want the first answer %q", i, i%2, j.status, j.joined, j.err, j.body, first.body)
					}
				}
				for i := range 2 {
					r := protoPost(fl.urls[i], p, stream, key, "secret-a")
					if r.err != nil || r.status != 200 || r.replay != "true" || r.joined != "" || !bytes.Equal(r.body, first.body) {
						t.Fatalf("replay on gateway %d: %+v", i, r)
					}
				}
				if n := fs.Stats().Requests; n != 1 {
					t.Fatalf("%d upstream requests for one key, want 1", n)
				}
				other := protoPost(fl.urls[1], p, stream, key, "secret-b")
				if other.err != nil || other.status != 200 || other.replay != "" || bytes.Equal(other.body, first.body) {
					t.Fatalf("the same key under another credential: %d replayed=%q %q; want a call of its own", other.status, other.replay, other.body)
				}
				if n := fs.Stats().Requests; n != 2 {
					t.Fatalf("%d upstream requests, want 2", n)
				}
			})
		}
	}
}
