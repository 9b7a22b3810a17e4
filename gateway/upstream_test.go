package gateway_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
)

// The upstream's own query (Azure OpenAI's api-version in ONCEFLOW_LLM_BASE_URL) is kept,
// and the caller's is appended; Proxy-Authorization, a hop-by-hop header, is not
// forwarded on the keyed path either.
func TestUpstreamQueryKeptAndProxyAuthorizationDropped(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var queries []string
	var proxyAuth []string
	ups := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		queries = append(queries, r.URL.RawQuery)
		proxyAuth = append(proxyAuth, r.Header.Get("Proxy-Authorization"))
		mu.Unlock()
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x"}`)
	}))
	t.Cleanup(ups.Close)
	pool, _ := testenv.Postgres(t)
	g, err := gateway.New(gateway.Config{Upstream: ups.URL + "/openai/deployments/d1?api-version=2024-10-21", DB: pool, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(g)
	t.Cleanup(gs.Close)
	h := http.Header{"Api-Key": {"azure-key"}, "Proxy-Authorization": {"Basic cHJveHk6c2VjcmV0"}}
	rawPost(t, gs.URL+"/v1/chat/completions?trace=1", chatBody, h)
	h.Set("Idempotency-Key", "azure-query-key-00001")
	rawPost(t, gs.URL+"/v1/chat/completions", chatBody, h)
	mu.Lock()
	defer mu.Unlock()
	if len(queries) != 2 || queries[0] != "api-version=2024-10-21&trace=1" || queries[1] != "api-version=2024-10-21" {
		t.Fatalf("upstream queries %q", queries)
	}
	for i, p := range proxyAuth {
		if p != "" {
			t.Errorf("request %d forwarded Proxy-Authorization %q", i, p)
		}
	}
}
