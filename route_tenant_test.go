package onceflow_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
)

// What Route and StateHandler answer for each outcome of the tenant function: 401 only
// when it says the request is unauthenticated; a failure to tell the tenant is the
// server's (500, or 503 with Retry-After when marked Unavailable), and so is a tenant
// onceflow cannot use (500, never a 400 that shows the client the server's tenant).
// None of them shows the error's text, and none enqueues anything.
func TestRouteTenantFunctionOutcomes(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	const secret = "key-store at 10.0.0.7 refused"
	tenant := func(r *http.Request) (string, error) {
		switch r.Header.Get("Authorization") {
		case "Bearer good":
			return "acme", nil
		case "Bearer unknown":
			return "", fmt.Errorf("no such key: %w", idempotency.ErrUnauthenticated)
		case "Bearer store-down":
			return "", onceflow.Unavailable(errors.New(secret))
		case "Bearer bug":
			return "", errors.New(secret)
		case "Bearer unusable":
			return "Tenant With Spaces " + secret, nil
		}
		return "", idempotency.ErrUnauthenticated
	}
	post, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{Tenant: tenant})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/tickets", post)
	mux.Handle("GET /v1/tickets/{job_id}", onceflow.StateHandler(c, tenant))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	for i, tc := range []struct {
		auth       string
		code       int
		retryAfter bool
	}{
		{"", http.StatusUnauthorized, false},
		{"unknown", http.StatusUnauthorized, false},
		{"store-down", http.StatusServiceUnavailable, true},
		{"bug", http.StatusInternalServerError, false},
		{"unusable", http.StatusInternalServerError, false},
	} {
		a := postJSON(t, srv.URL+"/v1/tickets", tc.auth, fmt.Sprintf("tenant-outcome-%04d", i), "application/json", `{"subject":"s","body":"b"}`)
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/v1/tickets/some-job", nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", "Bearer "+tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for what, got := range map[string]answer{"POST": a, "GET": {resp.StatusCode, resp.Header, string(b)}} {
			if got.code != tc.code || (got.header.Get("Retry-After") != "") != tc.retryAfter {
				t.Errorf("%s with %q: %d Retry-After %q, want %d (Retry-After: %v)", what, tc.auth, got.code, got.header.Get("Retry-After"), tc.code, tc.retryAfter)
			}
			if strings.Contains(got.body, "10.0.0.7") || strings.Contains(got.body, "Spaces") {
				t.Errorf("%s with %q shows the server's error or tenant: %s", what, tc.auth, got.body)
			}
		}
	}
	if n := rdb.Exists(t.Context(), prefix+":{default}:stream").Val(); n != 0 {
		t.Fatal("a request without a usable tenant enqueued a job")
	}
	if a := postJSON(t, srv.URL+"/v1/tickets", "good", "tenant-outcome-good", "application/json", `{"subject":"s","body":"b"}`); a.code != http.StatusAccepted {
		t.Fatalf("a good key: %d %s", a.code, a.body)
	}
}
