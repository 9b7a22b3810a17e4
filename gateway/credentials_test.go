package gateway_test

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

const messagesBody = `{"model":"claude-sonnet-4-5","max_tokens":64,"temperature":1,"messages":[{"role":"user","content":"Say one random word."}]}`

// send posts body to url with the Idempotency-Key key and the headers h (nil: none
// but the key and Content-Type) and returns the answer.
func send(t *testing.T, url, key, body string, h http.Header) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	for k, vs := range h {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, b)
	}
	return resp, b
}

// header builds an http.Header of name-value pairs, names canonicalised as a server
// receives them.
func header(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

// Two callers whose credentials travel in another header than Authorization (Anthropic's
// x-api-key, Azure OpenAI's api-key, a header the operator configured) send one key and
// one body: each gets its own upstream call, neither gets the other's answer, and each
// still gets its own answer replayed.
func TestCallersWithOtherCredentialHeadersDoNotShareReplays(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, path, body, header string
		cfg                      gateway.Config
	}{
		{name: "anthropic x-api-key", path: "/messages", body: messagesBody, header: "x-api-key"},
		{name: "azure api-key", path: "/chat/completions", body: chatBody, header: "api-key"},
		{name: "configured X-Custom-Key", path: "/chat/completions", body: chatBody, header: "X-Custom-Key",
			cfg: gateway.Config{CredentialHeaders: []string{"x-custom-key"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, fakeserver.Config{}, c.cfg)
			url, key := e.url+c.path, "credential-key-0000001"
			alice, bob := header(c.header, "sk-alice"), header(c.header, "sk-bob")
			ra, a := send(t, url, key, c.body, alice)
			rb, b := send(t, url, key, c.body, bob)
			if n := e.up.Stats().Requests; n != 2 || bytes.Equal(a, b) || rb.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("bob (another %s) got alice's answer: %d upstream requests, replayed %q", c.header, n, rb.Header.Get("Idempotent-Replayed"))
			}
			if ra.Header.Get("Idempotent-Replayed") != "" {
				t.Fatal("alice's first request was a replay")
			}
			// Each caller's own retry is still a replay of its own answer.
			for _, who := range []struct {
				h    http.Header
				want []byte
			}{{alice, a}, {bob, b}} {
				r, got := send(t, url, key, c.body, who.h)
				if r.Header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(got, who.want) {
					t.Fatalf("retry with %s %v: replayed %q, same answer %v", c.header, who.h, r.Header.Get("Idempotent-Replayed"), bytes.Equal(got, who.want))
				}
			}
			if n := e.up.Stats().Requests; n != 2 {
				t.Fatalf("%d upstream requests after the retries, want 2", n)
			}
		})
	}
}

// A request without any credential header never gets an answer recorded for one that
// had a credential (in any of the three headers), nor the other way round.
func TestRequestWithoutCredentialsGetsNoCredentialedReplay(t *testing.T) {
	t.Parallel()
	for _, h := range []string{"Authorization", "x-api-key", "api-key"} {
		t.Run(h, func(t *testing.T) {
			t.Parallel()
			e := setup(t, fakeserver.Config{}, gateway.Config{})
			url := e.url + "/chat/completions"
			_, owned := send(t, url, "anonymous-key-0000001", chatBody, header(h, "sk-alice"))
			r, anon := send(t, url, "anonymous-key-0000001", chatBody, nil)
			if n := e.up.Stats().Requests; n != 2 || bytes.Equal(owned, anon) || r.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("a request without credentials got the answer recorded under %s: %d upstream requests", h, n)
			}
			// The other way round: the credentialed caller does not get the anonymous answer.
			_, anonFirst := send(t, url, "anonymous-key-0000002", chatBody, nil)
			r, owned = send(t, url, "anonymous-key-0000002", chatBody, header(h, "sk-alice"))
			if n := e.up.Stats().Requests; n != 4 || bytes.Equal(owned, anonFirst) || r.Header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("a request with %s got the anonymous answer: %d upstream requests", h, n)
			}
			// Two requests without credentials do share their key (they are one caller).
			r, again := send(t, url, "anonymous-key-0000002", chatBody, nil)
			if r.Header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(again, anonFirst) || e.up.Stats().Requests != 4 {
				t.Fatalf("the anonymous retry was not a replay")
			}
		})
	}
}

// The scope is unambiguous: names are canonical, values are kept in order and never
// run into each other or into another header's, other headers do not count, and a
// request without any credential header has the zero Scope, which no credential header
// (not even an empty one) gives.
func TestCredentialScopeIsUnambiguous(t *testing.T) {
	t.Parallel()
	scope := gateway.CredentialScope
	distinct := []http.Header{
		{},
		{"Authorization": {""}},
		{"Authorization": {"a"}},
		{"X-Api-Key": {"a"}},
		{"Api-Key": {"a"}},
		{"X-Api-Key": {"a"}, "Api-Key": {"b"}},
		{"X-Api-Key": {"b"}, "Api-Key": {"a"}},
		{"Authorization": {"a", "b"}},
		{"Authorization": {"b", "a"}},
		{"Authorization": {"ab"}},
		{"Authorization": {"a\nb"}},
		{"Authorization": {"a", ""}},
		{"Authorization": {"a"}, "X-Api-Key": {""}},
	}
	seen := map[gateway.Scope]int{}
	keys := map[string]int{}
	for i, h := range distinct {
		s := scope(h)
		if j, dup := seen[s]; dup {
			t.Errorf("%v and %v share a scope", distinct[j], h)
		}
		seen[s] = i
		k := gateway.KeyFor(s, "same-idempotency-key-01")
		if j, dup := keys[k]; dup {
			t.Errorf("%v and %v share a key", distinct[j], h)
		}
		keys[k] = i
	}
	if scope(http.Header{}) != (gateway.Scope{}) || scope(http.Header{"Content-Type": {"application/json"}}) != (gateway.Scope{}) {
		t.Error("a request without credentials does not have the zero Scope")
	}
	lower := http.Header{}
	lower.Add("x-api-key", "a")
	if scope(lower) != scope(http.Header{"X-Api-Key": {"a"}}) || scope(http.Header{"X-Api-Key": {"a"}, "Content-Type": {"x"}}) != scope(lower) {
		t.Error("the scope depends on the case of names or on other headers")
	}
	custom := http.Header{"X-Custom-Key": {"a"}}
	if scope(custom) != (gateway.Scope{}) || scope(custom, "x-custom-key") == (gateway.Scope{}) ||
		scope(custom, "x-custom-key") != scope(custom, "X-CUSTOM-KEY", "x-custom-key") {
		t.Error("an extra credential header does not scope, or depends on its spelling")
	}
	if gateway.KeyFor(gateway.Scope{}, "k-0000000000000001") == gateway.KeyFor(gateway.Scope{}, "k-0000000000000002") {
		t.Error("two keys without credentials share a key")
	}
}

func TestInvalidCredentialHeaderIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	for _, name := range []string{"", "bad header", "X-Key:", "X-Ké"} {
		_, err := gateway.New(gateway.Config{Upstream: "http://127.0.0.1:1/v1", DB: pool, CredentialHeaders: []string{"X-Ok", name}})
		if err == nil || !strings.Contains(err.Error(), "CredentialHeaders") {
			t.Errorf("CredentialHeaders %q: %v", name, err)
		}
	}
}
