package onceflow_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

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
