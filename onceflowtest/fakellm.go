package onceflowtest

import (
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// FakeLLM is the fake model server (package llm/fakeserver: OpenAI's and Anthropic's
// wire formats, faults, tool-call scripting) in-process, with a count of the requests
// it received and a gate that holds them. Tell it which tool to call with
// fakeserver.Config.ToolChoice (fakeserver.CallTool, fakeserver.NoToolCalls, or a func
// of the request), and queue exact faults with Server.Script. Its methods are safe for
// concurrent use.
type FakeLLM struct {
	// URL is the server's root; OpenAI's API is under URL+"/v1".
	URL string
	// Server is the fake server, for Script and Stats.
	Server *fakeserver.Server

	requests atomic.Int64
	mu       sync.Mutex
	gate     chan struct{} // non-nil while held: requests wait until it is closed
}

// NewFakeLLM starts a fake model server with cfg, closed at cleanup.
func NewFakeLLM(t testing.TB, cfg fakeserver.Config) *FakeLLM {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = Logger(t)
	}
	s, err := fakeserver.New(cfg)
	if err != nil {
		t.Fatalf("fakeserver: %v", err)
	}
	f := &FakeLLM{Server: s}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			f.requests.Add(1)
			f.mu.Lock()
			gate := f.gate
			f.mu.Unlock()
			if gate != nil {
				select {
				case <-gate:
				case <-r.Context().Done():
					return
				}
			}
		}
		s.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { s.Close(); f.Release(); srv.Close() })
	f.URL = srv.URL
	return f
}

// Client returns an llm.Client of the server (the OpenAI adapter, llm/openai), for
// onceflow.Config.Model.
func (f *FakeLLM) Client() llm.Client {
	return openai.New(openai.Config{BaseURL: f.URL + "/v1", APIKey: "test-key"})
}

// Requests returns how many model requests arrived (POSTs, held, faulted or answered):
// the model calls a test asserts.
func (f *FakeLLM) Requests() int { return int(f.requests.Load()) }

// Hold makes model requests that arrive from now on wait, unanswered, until Release:
// a test holds the model to act while a worker waits for it.
func (f *FakeLLM) Hold() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gate == nil {
		f.gate = make(chan struct{})
	}
}

// Release answers the held requests and stops holding.
func (f *FakeLLM) Release() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gate != nil {
		close(f.gate)
		f.gate = nil
	}
}

// WaitRequests waits up to timeout until at least n model requests have arrived.
func (f *FakeLLM) WaitRequests(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	WaitFor(t, timeout, "model requests", func() bool { return f.Requests() >= n })
}
