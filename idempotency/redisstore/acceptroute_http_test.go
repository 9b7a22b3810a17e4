package redisstore

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/queue"
)

var benchKeys = map[string]string{"key-acme-0123456789": "acme", "key-globex-0123456789": "globex"}

func bearerTenant(r *http.Request) (string, error) {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if t, ok := benchKeys[tok]; ok {
		return t, nil
	}
	return "", fmt.Errorf("unknown API key: %w", idempotency.ErrUnauthenticated)
}

func newAcceptRoute(s *Store) (*acceptRoute, error) {
	mw, err := idempotency.New(idempotency.Config{Store: s, Tenant: bearerTenant, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	// The route's accept (with the queue's enqueue), loaded like the store's own scripts:
	// its first call is one round trip (EVALSHA), not two (NOSCRIPT, EVAL).
	if err := s.Preload(context.Background(), queue.StepFunctions()...); err != nil {
		return nil, err
	}
	return &acceptRoute{
		mw: mw, store: s, prefix: s.cfg.Prefix, stream: s.cfg.Prefix + ":{summaries}:stream",
		ns: uuid.MustParse("6f1d3c1e-6a55-4d0e-9d53-0b6f0c3f7a10"), timeout: 5 * time.Second,
	}, nil
}

// TestAcceptRouteOverHTTP drives the single-round-trip path through a real HTTP server:
// the status table of a route without an in-progress state, with the effects (stream
// entries) counted after every step.
func TestAcceptRouteOverHTTP(t *testing.T) {
	t.Parallel()
	s, rt := newTestStore(t, Config{})
	route, err := newAcceptRoute(s)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(route)
	defer srv.Close()
	post := func(apiKey, key, ctype, body string) (int, http.Header, string) {
		t.Helper()
		req, _ := http.NewRequest("POST", srv.URL+"/v1/summaries", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+apiKey)
		if ctype != "" {
			req.Header.Set("Content-Type", ctype)
		}
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}
	entries := func(want int64) {
		t.Helper()
		if n, _ := s.rdb.XLen(context.Background(), route.stream).Result(); n != want {
			t.Fatalf("stream has %d entries, want %d", n, want)
		}
	}
	const key = "route-key-0123456789"
	body := `{"text":"hello","notify":"a@example.com"}`
	rt.Reset()
	code, h, first := post("key-acme-0123456789", key, "application/json", body)
	if code != 202 || h.Get("Location") == "" || h.Get(idempotency.HeaderReplayed) != "" || !strings.Contains(first, `"status":"queued"`) {
		t.Fatalf("new: %d %v %s", code, h, first)
	}
	if n := rt.Redis(); n != 1 {
		t.Errorf("accepted request took %d Redis round trips, want 1", n)
	}
	entries(1)
	code, h, again := post("key-acme-0123456789", idempotency.QuoteKey(key), "application/json", "{ \"notify\": \"a@example.com\", \"text\": \"hello\" }")
	if code != 202 || h.Get(idempotency.HeaderReplayed) != "true" || again != first {
		t.Fatalf("replay: %d %v %s", code, h, again)
	}
	entries(1)
	if code, _, b := post("key-acme-0123456789", key, "application/json", `{"text":"other","notify":"a@example.com"}`); code != 422 {
		t.Fatalf("different body: %d %s", code, b)
	}
	// Another tenant, same key: its own job, with another job id.
	code, _, other := post("key-globex-0123456789", key, "application/json", body)
	if code != 202 || other == first {
		t.Fatalf("second tenant: %d %s", code, other)
	}
	entries(2)
	for name, c := range map[string]struct {
		apiKey, key, ctype, body string
		want                     int
	}{
		"missing key":   {"key-acme-0123456789", "", "application/json", body, 400},
		"bad key":       {"key-acme-0123456789", "short", "application/json", body, 400},
		"unknown field": {"key-acme-0123456789", "route-key-unknown-fld", "application/json", `{"text":"a","notify":"a@example.com","x":1}`, 400},
		"bad email":     {"key-acme-0123456789", "route-key-bad-email-1", "application/json", `{"text":"a","notify":"nope"}`, 400},
		"content type":  {"key-acme-0123456789", "route-key-ctype-00001", "text/plain", body, 415},
		"too large":     {"key-acme-0123456789", "route-key-large-00001", "application/json", `{"text":"` + strings.Repeat("x", 1<<20) + `"}`, 413},
		"unauthorized":  {"nope", "route-key-unauth-0001", "application/json", body, 401},
	} {
		if code, _, b := post(c.apiKey, c.key, c.ctype, c.body); code != c.want {
			t.Errorf("%s: %d %s, want %d", name, code, b, c.want)
		}
	}
	entries(2)
}
