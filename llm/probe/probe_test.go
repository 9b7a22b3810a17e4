package probe_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/probe"
)

func fakeLLM(t *testing.T, cfg fakeserver.Config) (*fakeserver.Server, string) {
	t.Helper()
	cfg.Logger = testenv.Logger(t)
	srv, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(func() { srv.Close(); hs.Close() })
	return srv, hs.URL + "/v1"
}

func TestProbeTellsHonouredIgnoredAndInconclusiveApart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		cfg    fakeserver.Config
		script []fakeserver.Fault
		want   probe.Verdict
		reason string
	}{
		{"honouring provider", fakeserver.Config{HonourIdempotency: true}, nil, probe.Honoured, "replayed"},
		{"ignoring provider", fakeserver.Config{}, nil, probe.Ignored, "two generations"},
		{"a failed call", fakeserver.Config{}, []fakeserver.Fault{{Kind: fakeserver.Fault503}}, probe.Inconclusive, "first request failed"},
		{"a malformed answer", fakeserver.Config{}, []fakeserver.Fault{{}, {Kind: fakeserver.FaultMalformed}}, probe.Inconclusive, "second request failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv, base := fakeLLM(t, tc.cfg)
			srv.Script(tc.script...)
			r, err := probe.Run(context.Background(), probe.Config{BaseURL: base, Model: "gpt-4.1-mini", APIKey: "sk-secret-value"})
			if err != nil {
				t.Fatal(err)
			}
			if r.Verdict != tc.want || !strings.Contains(r.Reason, tc.reason) {
				t.Fatalf("%s (%s), want %s; %+v", r.Verdict, r.Reason, tc.want, r)
			}
			st := srv.Stats()
			if st.Requests != 2 || st.ByIdempotencyKey[r.Key] != 2 || !strings.HasPrefix(r.Key, "probe-") {
				t.Fatalf("the probe sent %d requests, %v by key, key %q; want one key twice", st.Requests, st.ByIdempotencyKey, r.Key)
			}
			if tc.want == probe.Honoured && (r.First.ID != r.Second.ID || !r.Second.Replayed || r.First.Content == "") {
				t.Fatalf("%+v", r)
			}
			if tc.want == probe.Ignored && r.First.ID == r.Second.ID {
				t.Fatalf("%+v", r)
			}
			out := r.String()
			if strings.Contains(out, "sk-secret-value") || !strings.Contains(out, string(tc.want)) {
				t.Fatalf("output:\n%s", out)
			}
		})
	}
}

func TestPromptIsNonDeterministic(t *testing.T) {
	t.Parallel()
	var body string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		body = string(b)
		http.Error(w, `{"error":{"message":"nope"}}`, http.StatusTeapot)
	}))
	t.Cleanup(srv.Close)
	r, err := probe.Run(context.Background(), probe.Config{BaseURL: srv.URL, Model: "m", Key: "probe-fixed-key-123"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(body, `"temperature":1`) || !strings.Contains(body, probe.DefaultPrompt) || r.Verdict != probe.Inconclusive || r.First.Status != http.StatusTeapot {
		t.Fatalf("body %s; result %+v", body, r)
	}
	if _, err := probe.Run(context.Background(), probe.Config{BaseURL: "ftp://x", Model: "m"}); err == nil {
		t.Fatal("ftp base URL accepted")
	}
	if _, err := probe.Run(context.Background(), probe.Config{BaseURL: srv.URL}); err == nil {
		t.Fatal("no model accepted")
	}
}
