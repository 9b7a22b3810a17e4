package cli

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// `onceflow serve` on a Redis Cluster of 3 primaries (no replicas): one primary killed,
// /readyz answers 200 and names it (degraded); every primary killed, 503.
func TestServeReadyzOnAClusterWithSilentPrimaries(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 0)
	_, dsn := testenv.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	p := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_CLUSTER_ADDRS=" + strings.Join(c.Addrs(), ","), "ONCEFLOW_DATABASE_URL=" + dsn,
		"ONCEFLOW_PREFIX=" + testenv.Prefix(t), "ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
	}, "serve")
	base := fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])
	awaitReady(t, base)
	dead := c.Addrs()[1]
	c.Nodes[1].Kill()
	var code int
	var body string
	testenv.WaitFor(t, 30*time.Second, "/readyz naming the dead primary", func() bool {
		code, body = httpGet(t, base+"/readyz", "")
		return strings.Contains(body, dead)
	})
	if code != http.StatusOK {
		t.Fatalf("one primary of 3 killed: /readyz %d %s, want 200 (degraded)", code, body)
	}
	for _, a := range []string{c.Addrs()[0], c.Addrs()[2]} {
		if strings.Contains(body, a) {
			t.Fatalf("/readyz names %s, which answers: %s", a, body)
		}
	}
	c.Nodes[0].Kill()
	c.Nodes[2].Kill()
	testenv.WaitFor(t, 30*time.Second, "/readyz 503 with every primary down", func() bool {
		code, body = httpGet(t, base+"/readyz", "")
		return code == http.StatusServiceUnavailable
	})
}
