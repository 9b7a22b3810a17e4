package idempotency_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
)

// A request whose body does not arrive before the server's read deadline is answered
// 408 naming the problem, the handler does not run and the key stays free; it counts as
// timeout_408.
func TestBodyReadTimeoutIs408(t *testing.T) {
	t.Parallel()
	h := newHarness(t, idempotency.Config{}, created)
	slow := httptest.NewUnstartedServer(h.srv.Config.Handler)
	slow.Config.ReadTimeout = 500 * time.Millisecond
	slow.Start()
	t.Cleanup(slow.Close)
	conn, err := net.Dial("tcp", slow.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"text":"hello","notify":"a@example.com"}`
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-acme\r\n%s: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		path, idempotency.HeaderKey, key1, len(body), body[:5]) // the rest never comes
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	defer resp.Body.Close()
	var got struct {
		Detail string `json:"detail"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(got.Detail, "request body") {
		t.Fatalf("got %d %+v (%v), want 408 with a detail naming the request body", resp.StatusCode, got, err)
	}
	if n := h.runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times", n)
	}
	if r := h.post("key-acme", key1, body1); r.status != http.StatusCreated {
		t.Fatalf("the key is not free after the timeout: %d %s", r.status, r.body)
	}
	h.wantOutcomes(map[string]float64{"timeout_408": 1, "new": 1})
}
