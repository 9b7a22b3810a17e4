package webhooksink

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

func post(t *testing.T, url, key, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

func TestRecordsDeliveriesAndReportsCountsPerKey(t *testing.T) {
	s := New(Options{})
	srv := httptest.NewServer(s)
	defer srv.Close()
	for _, k := range []string{"a", "b", "a", "a", ""} {
		if resp := post(t, srv.URL, k, `{"topic":"t"}`); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	s.FailNext(2)
	for range 2 {
		if resp := post(t, srv.URL, "c", `{}`); resp.StatusCode != 503 {
			t.Fatalf("injected failure answered %d", resp.StatusCode)
		}
	}
	resp, err := http.Get(srv.URL + "/?deliveries=1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got struct {
		Stats
		Delivered []Delivery `json:"delivered"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	if got.Deliveries != 5 || got.DistinctKeys != 3 || got.Duplicates["a"] != 3 || len(got.Duplicates) != 1 ||
		got.Failed != 2 || got.MissingKey != 1 || len(got.Delivered) != 5 || string(got.Delivered[0].Body) != `{"topic":"t"}` {
		t.Fatalf("stats %+v", got)
	}
	if s.Count("a") != 3 || s.Count("c") != 0 || strings.Join(s.Keys(), ",") != ",a,b" {
		t.Fatalf("Count/Keys: %d %d %v", s.Count("a"), s.Count("c"), s.Keys())
	}
}

func TestLatencyAndFailRate(t *testing.T) {
	s := New(Options{Latency: 50 * time.Millisecond, FailRate: 1, FailStatus: 429, RetryAfter: 3 * time.Second, Seed: 1})
	srv := httptest.NewServer(s)
	defer srv.Close()
	start := time.Now()
	resp := post(t, srv.URL, "k", `{}`)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "3" {
		t.Fatalf("status %d Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if time.Since(start) < 50*time.Millisecond {
		t.Fatal("latency not applied")
	}
	if st := s.Stats(); st.Deliveries != 0 || st.Failed != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// With an answer set, the sink answers like an API that honours Idempotency-Key: the
// first answer of each key is replayed to its later POSTs, which are still recorded.
func TestSinkReplaysItsFirstAnswerPerKey(t *testing.T) {
	s := New(Options{})
	srv := httptest.NewServer(s)
	defer srv.Close()
	n := 0
	s.SetAnswer(func(key string, body []byte) []byte {
		n++
		return []byte(`{"refund":"re_` + strconv.Itoa(n) + `"}`)
	})
	read := func(key string) (string, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"amount":5}`))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b), resp.Header.Get("Idempotent-Replayed")
	}
	for _, c := range []struct{ key, body, replayed string }{
		{"k1", `{"refund":"re_1"}`, ""},
		{"k1", `{"refund":"re_1"}`, "true"},
		{"k2", `{"refund":"re_2"}`, ""},
		{"", `{"refund":"re_3"}`, ""},
		{"", `{"refund":"re_4"}`, ""},
	} {
		if body, replayed := read(c.key); body != c.body || replayed != c.replayed {
			t.Fatalf("key %q: %s (replayed %q), want %s (replayed %q)", c.key, body, replayed, c.body, c.replayed)
		}
	}
	if s.Count("k1") != 2 {
		t.Fatalf("k1 recorded %d times, want 2: a replay is still a delivery", s.Count("k1"))
	}
}
