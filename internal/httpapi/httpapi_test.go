package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/onceflow/onceflow/breaker"
)

func TestReadyzNamesTheDependencyThatIsDown(t *testing.T) {
	s := New(Config{Checks: map[string]Check{
		"redis":    func(context.Context) error { return errors.New("connection refused") },
		"postgres": func(context.Context) error { return nil },
	}})
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable {
		t.Fatalf("code %d", rec.Code)
	}
	var body struct {
		Status string            `json:"status"`
		Checks map[string]string `json:"checks"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if body.Status != "unavailable" || body.Checks["redis"] != "unavailable: connection refused" || body.Checks["postgres"] != "ok" {
		t.Fatalf("body %+v", body)
	}
}

// A degraded check is named but keeps /readyz at 200 ("degraded"); with a failing
// check beside it the answer is 503 ("unavailable") and names both.
func TestReadyzReportsDegradedWithoutFailing(t *testing.T) {
	for _, tc := range []struct {
		redis  error
		code   int
		status string
	}{{nil, http.StatusOK, "degraded"}, {errors.New("connection refused"), http.StatusServiceUnavailable, "unavailable"}} {
		s := New(Config{Checks: map[string]Check{
			"redis": func(context.Context) error { return tc.redis },
			"llm":   func(context.Context) error { return Degraded(errors.New("llm unavailable since 09:00: quota")) },
		}})
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
		var body struct {
			Status string            `json:"status"`
			Checks map[string]string `json:"checks"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
			t.Fatal(err)
		}
		if rec.Code != tc.code || body.Status != tc.status || body.Checks["llm"] != "degraded: llm unavailable since 09:00: quota" {
			t.Fatalf("redis %v: %d %+v, want %d %s with the llm named", tc.redis, rec.Code, body, tc.code, tc.status)
		}
	}
	if Degraded(nil) != nil {
		t.Fatal("Degraded(nil) is not nil")
	}
}

func TestReadyzTimesOutAHungCheck(t *testing.T) {
	s := New(Config{ReadyTimeout: 50 * time.Millisecond, Checks: map[string]Check{
		"redis": func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() },
	}})
	rec := httptest.NewRecorder()
	start := time.Now()
	s.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "deadline exceeded") {
		t.Fatalf("code %d body %s", rec.Code, rec.Body)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("a hung check held /readyz for %v", time.Since(start))
	}
}

func TestRequestsCountedByRouteAndCode(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg})
	s.Handle("POST /things/{id}", "/things/{id}", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.PathValue("id") {
		case "bad":
			WriteError(w, http.StatusBadRequest, "bad thing")
		case "boom":
			panic("boom")
		default:
			w.WriteHeader(http.StatusAccepted)
		}
	}))
	for _, id := range []string{"a", "b", "bad"} {
		s.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("POST", "/things/"+id, nil))
	}
	func() {
		defer func() { _ = recover() }()
		s.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("POST", "/things/boom", nil))
	}()
	for code, want := range map[string]float64{"202": 2, "400": 1, "500": 1} {
		got := testutil.ToFloat64(s.metrics.requests.WithLabelValues("/things/{id}", code))
		if got != want {
			t.Errorf("requests{code=%s} = %v, want %v", code, got, want)
		}
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest("POST", "/things/bad", nil))
	if rec.Header().Get("Content-Type") != "application/json" || strings.TrimSpace(rec.Body.String()) != `{"detail":"bad thing"}` {
		t.Errorf("error response %q %q", rec.Header().Get("Content-Type"), rec.Body)
	}
}

func TestRouteCodesAreVisibleAtZeroBeforeTheFirstRequest(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg})
	s.Handle("POST /things", "/things", http.NotFoundHandler(), http.StatusAccepted, http.StatusBadRequest)
	// Gathered before anything touches the vector: /healthz 200, /readyz 200 and 503,
	// /metrics 200, /things 202 and 400.
	n, err := testutil.GatherAndCount(reg, "onceflow_http_requests_total")
	if err != nil {
		t.Fatal(err)
	}
	if n != 6 {
		t.Fatalf("%d series of onceflow_http_requests_total before any request, want 6", n)
	}
	for _, labels := range [][2]string{{"/things", "202"}, {"/things", "400"}, {"/healthz", "200"}, {"/readyz", "503"}} {
		if got := testutil.ToFloat64(s.metrics.requests.WithLabelValues(labels[0], labels[1])); got != 0 {
			t.Errorf("%v = %v before any request", labels, got)
		}
	}
}

// A request no route matches gets the API's JSON error, not net/http's text/plain: 404
// for an unknown path, 405 with Allow for a known path with another method.
func TestUnroutedRequestsGetJSONErrors(t *testing.T) {
	s := New(Config{})
	s.Handle("GET /things/{id}", "/things/{id}", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		WriteJSON(w, http.StatusOK, map[string]string{"id": r.PathValue("id")})
	}))
	for _, tc := range []struct {
		method, path string
		code         int
		allow        string
	}{
		{"GET", "/nowhere", http.StatusNotFound, ""},
		{"POST", "/things/7", http.StatusMethodNotAllowed, "GET, HEAD"},
		{"DELETE", "/healthz", http.StatusMethodNotAllowed, "GET, HEAD"},
	} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		var body map[string]string
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != tc.code || body["detail"] == "" ||
			rec.Header().Get("Content-Type") != "application/json" || rec.Header().Get("Allow") != tc.allow {
			t.Errorf("%s %s: %d %v %q, want %d with a JSON detail and Allow %q", tc.method, tc.path, rec.Code, rec.Header(), rec.Body, tc.code, tc.allow)
		}
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest("GET", "/things/7", nil))
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"id":"7"`) {
		t.Fatalf("routed request: %d %s", rec.Code, rec.Body)
	}
}

// Mounted routes (a program's workflows' mux) are served beside the server's own, each
// request counted under the path of the pattern it matched, with its path values; a
// request none matches gets the JSON 404, or 405 with the mounted route's Allow, and is
// not counted.
func TestMountedRoutesAreCountedByTheirPattern(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := New(Config{Registry: reg})
	mux := http.NewServeMux()
	mux.HandleFunc("POST /things", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusAccepted) })
	mux.HandleFunc("GET /things/{id}", func(w http.ResponseWriter, r *http.Request) {
		WriteJSON(w, http.StatusOK, map[string]string{"id": r.PathValue("id")})
	})
	s.Mount(mux)
	s.Statuses("POST /things", http.StatusAccepted, http.StatusBadRequest)
	if got, err := testutil.GatherAndCount(reg, "onceflow_http_requests_total"); err != nil || got != 6 {
		t.Fatalf("%d series before any request (%v), want 6: the server's 4 and the mounted route's 202 and 400", got, err)
	}
	for _, tc := range []struct {
		method, path string
		code         int
		allow        string
	}{
		{"POST", "/things", http.StatusAccepted, ""},
		{"POST", "/things", http.StatusAccepted, ""},
		{"GET", "/things/7", http.StatusOK, ""},
		{"GET", "/healthz", http.StatusOK, ""},
		{"GET", "/things", http.StatusMethodNotAllowed, "POST"},
		{"GET", "/nowhere", http.StatusNotFound, ""},
	} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		if rec.Code != tc.code || rec.Header().Get("Allow") != tc.allow {
			t.Errorf("%s %s: %d Allow %q, want %d Allow %q", tc.method, tc.path, rec.Code, rec.Header().Get("Allow"), tc.code, tc.allow)
		}
		if tc.code >= 400 && rec.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %q, want a JSON detail", tc.method, tc.path, rec.Body)
		}
		if tc.path == "/things/7" && !strings.Contains(rec.Body.String(), `"id":"7"`) {
			t.Errorf("GET /things/7: %s, want its path value", rec.Body)
		}
	}
	for labels, want := range map[[2]string]float64{
		{"/things", "202"}: 2, {"/things/{id}", "200"}: 1, {"/healthz", "200"}: 1,
		{"/things", "405"}: 0, {"/nowhere", "404"}: 0,
	} {
		if got := testutil.ToFloat64(s.metrics.requests.WithLabelValues(labels[0], labels[1])); got != want {
			t.Errorf("requests%v = %v, want %v", labels, got, want)
		}
	}
}

func TestRouteLabelIsThePatternsPath(t *testing.T) {
	for pattern, want := range map[string]string{
		"/": "/", "POST /v1/summaries": "/v1/summaries", "GET /v1/summaries/{job_id}": "/v1/summaries/{job_id}",
		"example.com/x": "/x", "GET  example.com/y/{z...}": "/y/{z...}",
	} {
		if got := routeLabel(pattern); got != want {
			t.Errorf("routeLabel(%q) = %q, want %q", pattern, got, want)
		}
	}
}

// An open breaker is reported with since when and why, at once, without calling the
// dependency behind it (which hangs here); a degraded one keeps 200.
func TestReadyzReportsAnOpenBreakerSince(t *testing.T) {
	since := time.Date(2026, 12, 1, 18, 10, 0, 0, time.UTC)
	newBreaker := func(name string) *breaker.Breaker {
		b, err := breaker.New(breaker.Config{Name: name, Now: func() time.Time { return since }})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	pg, llm := newBreaker("postgres"), newBreaker("llm")
	hung := func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }
	s := New(Config{ReadyTimeout: time.Minute, Checks: map[string]Check{
		"postgres": BreakerCheck(pg, hung),
		"llm":      func(context.Context) error { return Degraded(llm.Err()) },
	}})
	pg.Trip(errors.New("5 failures in a row, the last: connection refused"), 0)
	llm.Trip(errors.New("insufficient_quota"), 0)
	rec := httptest.NewRecorder()
	start := time.Now()
	s.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	var body struct {
		Status string            `json:"status"`
		Checks map[string]string `json:"checks"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if rec.Code != http.StatusServiceUnavailable || body.Status != "unavailable" ||
		body.Checks["postgres"] != "unavailable since 2026-12-01T18:10:00Z: 5 failures in a row, the last: connection refused" ||
		body.Checks["llm"] != "degraded: unavailable since 2026-12-01T18:10:00Z: insufficient_quota" {
		t.Fatalf("code %d body %s", rec.Code, rec.Body)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("/readyz waited %v for the dependency behind an open breaker", took)
	}
}
