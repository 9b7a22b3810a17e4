package onceflow_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

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

// opsReport is a kind whose arguments carry a default tenant (JobArgsWithOpts).
type opsReport struct {
	Title string `json:"title"`
}

func (opsReport) Kind() string { return "ops.report" }

func (opsReport) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Tenant: "ops"} }

// A route's tenant is the tenant function's answer for the request, and nothing else.
func TestRouteTenant(t *testing.T) {
	t.Parallel()
	// A request whose tenant is "" (a tenant function may return "" for none) enqueues a
	// job of tenant "", never of the kind's default tenant (JobArgsWithOpts): the tenant
	// the request authenticated as reads its job, and no other.
	t.Run("comes from the request, never from the kind", func(t *testing.T) {
		t.Parallel()
		rdb, prefix := testenv.Redis(t)
		c := newClient(t, rdb, prefix, nil, nil)
		none := func(*http.Request) (string, error) { return "", nil }
		post, err := onceflow.Route(c, onceflow.RouteConfig[opsReport]{Tenant: none})
		if err != nil {
			t.Fatal(err)
		}
		mux := http.NewServeMux()
		mux.Handle("POST /v1/reports", post)
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		a := postJSON(t, srv.URL+"/v1/reports", "", "report-key-0000000001", "application/json", `{"title":"weekly"}`)
		if a.code != http.StatusAccepted {
			t.Fatalf("POST: %d %s", a.code, a.body)
		}
		var accepted struct {
			JobID string `json:"job_id"`
		}
		if err := json.Unmarshal([]byte(a.body), &accepted); err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if st, err := c.JobState(ctx, "ops", accepted.JobID); err == nil {
			t.Errorf("tenant ops reads the job a request of tenant \"\" enqueued: %+v", st)
		}
		if st, err := c.JobState(ctx, "", accepted.JobID); err != nil || st.Status != onceflow.StatusQueued {
			t.Fatalf("the request's own tenant \"\" reads its job: %+v, %v; want queued", st, err)
		}
	})
	// What Route and StateHandler answer for each outcome of the tenant function: 401 only
	// when it says the request is unauthenticated; a failure to tell the tenant is the
	// server's (500, or 503 with Retry-After when marked Unavailable), and so is a tenant
	// onceflow cannot use (500, never a 400 that shows the client the server's tenant).
	// None of them shows the error's text, and none enqueues anything.
	t.Run("each outcome of the tenant function", func(t *testing.T) {
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
	})
}

// A route's queue is fixed when the route is made (RouteConfig.Queue, else the kind's
// own).
func TestRouteQueue(t *testing.T) {
	t.Parallel()
	// A key names one job whatever the body: the same key with another body is 422, and
	// nothing more is enqueued on any queue.
	t.Run("is fixed, so a key is one job", func(t *testing.T) {
		t.Parallel()
		rdb, prefix := testenv.Redis(t)
		c := newClient(t, rdb, prefix, nil, map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {}, "urgent": {}})
		post, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{
			Tenant: func(*http.Request) (string, error) { return "acme", nil },
			Queue:  "urgent",
		})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(post)
		t.Cleanup(srv.Close)
		const key = "ticket-key-000000000001"
		if a := postJSON(t, srv.URL, "", key, "application/json", `{"subject":"refund me","body":"b"}`); a.code != http.StatusAccepted {
			t.Fatalf("first POST: %d %s", a.code, a.body)
		}
		if a := postJSON(t, srv.URL, "", key, "application/json", `{"subject":"refund me twice","body":"b"}`); a.code != http.StatusUnprocessableEntity {
			t.Errorf("the same key with another body: %d %s; want 422", a.code, a.body)
		}
		ctx := context.Background()
		if u, d := rdb.XLen(ctx, c.Inspector().QueueKeys("urgent").Stream()).Val(), rdb.XLen(ctx, c.Inspector().QueueKeys(onceflow.DefaultQueue).Stream()).Val(); u != 1 || d != 0 {
			t.Fatalf("jobs on urgent %d, on default %d; want 1 and 0", u, d)
		}
	})
	// The server's mistake, found at once, never a 400 that shows a client the server's
	// configuration.
	t.Run("that onceflow cannot use is refused when the route is made", func(t *testing.T) {
		t.Parallel()
		rdb, prefix := testenv.Redis(t)
		c := newClient(t, rdb, prefix, nil, nil)
		_, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{
			Tenant: func(*http.Request) (string, error) { return "acme", nil },
			Queue:  "internal:billing-7", // a colon: not a usable queue name
		})
		if err == nil || !strings.Contains(err.Error(), "internal:billing-7") {
			t.Fatalf("Route with an unusable queue: %v, want an error naming it", err)
		}
	})
}

// A client that sends its headers and then trickles its body is cut off by the route's
// own BodyReadTimeout, on a server with no read timeout at all: 408, nothing enqueued;
// the next request on a fresh connection is served as usual.
func TestRouteCutsOffASlowBody(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	post, err := onceflow.Route(c, onceflow.RouteConfig[ticketArgs]{
		Tenant:          bearerTenants(map[string]string{"acme-key-0123456789": "acme"}),
		BodyReadTimeout: 300 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(post) // http.Server without ReadTimeout
	t.Cleanup(srv.Close)
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"subject":"s","body":"b"}`
	fmt.Fprintf(conn, "POST /v1/tickets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer acme-key-0123456789\r\nIdempotency-Key: slow-body-0000001\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body[:5])
	for i := 5; i < 7; i++ { // a byte now and then, never the whole body
		time.Sleep(100 * time.Millisecond)
		if _, err := conn.Write([]byte{body[i]}); err != nil {
			t.Fatal(err)
		}
	}
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a body that never completes: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("slow body: %d, want 408", resp.StatusCode)
	}
	if n := rdb.Exists(t.Context(), prefix+":{default}:stream").Val(); n != 0 {
		t.Fatal("a body that never arrived enqueued a job")
	}
	if a := postJSON(t, srv.URL, "acme-key-0123456789", "slow-body-0000002", "application/json", body); a.code != http.StatusAccepted {
		t.Fatalf("a normal request afterwards: %d %s", a.code, strings.TrimSpace(a.body))
	}
}

type pathRefund struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

func (pathRefund) Kind() string { return "test.refund-request" }

// RouteConfig.Args fills job arguments from the request's path; the body stays strict
// JSON, and the key's fingerprint covers what Args set: the same key on the same path
// with the same body is replayed, another amount is 422.
func TestRouteFillsArgumentsFromThePath(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	c := newClient(t, rdb, prefix, nil, nil)
	post, err := onceflow.Route(c, onceflow.RouteConfig[pathRefund]{
		Tenant: func(*http.Request) (string, error) { return "acme", nil },
		Args: func(r *http.Request, args *pathRefund) error {
			order := r.PathValue("order")
			if !strings.HasPrefix(order, "A-") {
				return fmt.Errorf("order: %q is not an order id", order)
			}
			args.Order = order
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/orders/{order}/refunds", post)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	const key = "refund-key-0000000000001"
	if a := postJSON(t, srv.URL+"/v1/orders/A-17/refunds", "", key, "application/json", `{"amount":500}`); a.code != http.StatusAccepted {
		t.Fatalf("POST: %d %s", a.code, a.body)
	}
	if a := postJSON(t, srv.URL+"/v1/orders/A-17/refunds", "", key, "application/json", `{ "amount": 500 }`); a.code != http.StatusAccepted || a.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the same request again: %d %s, want the replayed 202", a.code, a.body)
	}
	if a := postJSON(t, srv.URL+"/v1/orders/A-17/refunds", "", key, "application/json", `{"amount":900}`); a.code != http.StatusUnprocessableEntity {
		t.Fatalf("the same key with another amount: %d %s, want 422", a.code, a.body)
	}
	if a := postJSON(t, srv.URL+"/v1/orders/B-1/refunds", "", "refund-key-0000000000002", "application/json", `{"amount":1}`); a.code != http.StatusBadRequest || !strings.Contains(a.body, "not an order id") {
		t.Fatalf("a path value Args refuses: %d %s, want 400 with its reason", a.code, a.body)
	}
	if a := postJSON(t, srv.URL+"/v1/orders/A-17/refunds", "", "refund-key-0000000000003", "application/json", `{"amount":1,"note":"x"}`); a.code != http.StatusBadRequest {
		t.Fatalf("an unknown body field: %d %s, want 400", a.code, a.body)
	}
	msgs, err := rdb.XRange(context.Background(), c.Inspector().QueueKeys(onceflow.DefaultQueue).Stream(), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 1 || !strings.Contains(fmt.Sprint(msgs[0].Values), `{"order":"A-17","amount":500}`) {
		t.Fatalf("enqueued %v, want one job whose arguments carry the path's order", msgs)
	}
}
