package onceflow_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

type ticketArgs struct {
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

func (ticketArgs) Kind() string { return "ticket" }

// bearerTenants authenticates test requests: the tenant comes from the API key.
func bearerTenants(keys map[string]string) func(*http.Request) (string, error) {
	return func(r *http.Request) (string, error) {
		if t, ok := keys[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]; ok {
			return t, nil
		}
		return "", idempotency.ErrUnauthenticated
	}
}

type answer struct {
	code   int
	header http.Header
	body   string
}

func postJSON(t *testing.T, url, apiKey, key, contentType, body string) answer {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", contentType)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// Route gives any kind the Idempotency-Key semantics of the summaries route: 202 with
// a derived job id and Location, a byte-identical replay, 422 for another body, 400
// naming the field for strict decoding and validation, 415, 401, and two tenants' same
// key as two jobs; every accept is one Redis round trip.
func TestRouteIdempotencySemantics(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	h, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{
		Tenant: bearerTenants(map[string]string{"acme-key-0123456789": "acme", "globex-key-0123456789": "globex"}),
		Validate: func(a *ticketArgs) error {
			if strings.TrimSpace(a.Subject) == "" {
				return errors.New("subject: required")
			}
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/tickets", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	url := srv.URL + "/v1/tickets"
	const key = "ticket-key-000000001"
	body := `{"subject":"Refund","body":"Order 17 arrived broken."}`
	// Warm the script cache, then count: a new key and a replay each cost one round trip.
	postJSON(t, url, "acme-key-0123456789", "ticket-key-warm-00001", "application/json", body)
	trips := &roundtrip.Counter{}
	rdb.AddHook(trips)

	first := postJSON(t, url, "acme-key-0123456789", key, "application/json", body)
	if n := trips.Redis(); n != 1 {
		t.Fatalf("a new key cost %d Redis round trips, want 1", n)
	}
	var a struct {
		JobID  string `json:"job_id"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal([]byte(first.body), &a); err != nil || first.code != http.StatusAccepted || a.Status != "queued" {
		t.Fatalf("first POST: %d %s", first.code, first.body)
	}
	wantID := onceflow.JobID(idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/tickets", Key: key})
	if a.JobID != wantID || first.header.Get("Location") != "/v1/tickets/"+wantID {
		t.Fatalf("job id %s, Location %q; want %s", a.JobID, first.header.Get("Location"), wantID)
	}
	// The same request with other whitespace and key order: a replay, byte for byte.
	again := postJSON(t, url, "acme-key-0123456789", `"`+key+`"`, "application/json; charset=utf-8", `{ "body":"Order 17 arrived broken.", "subject":"Refund" }`)
	if again.code != http.StatusAccepted || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %q %v", again.code, again.body, again.header)
	}
	if n := trips.Redis(); n != 2 {
		t.Fatalf("a new key and its replay cost %d Redis round trips, want 2", n)
	}
	if r := postJSON(t, url, "acme-key-0123456789", key, "application/json", `{"subject":"Other","body":""}`); r.code != http.StatusUnprocessableEntity {
		t.Fatalf("another body: %d %s", r.code, r.body)
	}
	cases := []struct {
		name, apiKey, key, ct, body string
		code                        int
		detail                      string
	}{
		{"no key", "acme-key-0123456789", "", "application/json", body, 400, "Idempotency-Key"},
		{"short key", "acme-key-0123456789", "short", "application/json", body, 400, "16 to 128"},
		{"unknown api key", "nope", key, "application/json", body, 401, ""},
		{"content type", "acme-key-0123456789", "ticket-key-000000002", "text/plain", body, 415, "application/json"},
		{"case-folded field", "acme-key-0123456789", "ticket-key-000000003", "application/json", `{"Subject":"x","body":"y"}`, 400, "Subject: unknown field"},
		{"duplicate field", "acme-key-0123456789", "ticket-key-000000004", "application/json", `{"subject":"x","subject":"y","body":"z"}`, 400, "subject"},
		{"validation", "acme-key-0123456789", "ticket-key-000000005", "application/json", `{"subject":" ","body":"z"}`, 400, "subject: required"},
		{"too large", "acme-key-0123456789", "ticket-key-000000006", "application/json", `{"subject":"x","body":"` + strings.Repeat("y", 1<<20) + `"}`, 413, ""},
	}
	for _, tc := range cases {
		r := postJSON(t, url, tc.apiKey, tc.key, tc.ct, tc.body)
		if r.code != tc.code || !strings.Contains(r.body, tc.detail) {
			t.Errorf("%s: %d %s, want %d mentioning %q", tc.name, r.code, r.body, tc.code, tc.detail)
		}
	}
	other := postJSON(t, url, "globex-key-0123456789", key, "application/json", body)
	if other.code != http.StatusAccepted || other.body == first.body {
		t.Fatalf("another tenant's same key: %d %s", other.code, other.body)
	}
	if n := rdb.XLen(context.Background(), prefix+":{default}:stream").Val(); n != 3 {
		t.Fatalf("%d jobs in the stream, want 3 (the warm-up and one per tenant)", n)
	}
}
