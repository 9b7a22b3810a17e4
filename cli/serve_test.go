package cli_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/internal/testenv"
)

// serveWithRedisURL runs `onceflow serve` with redisURL and the test's PostgreSQL, and returns
// its output and what it returned or panicked with.
func serveWithRedisURL(t *testing.T, redisURL string) (stderr string, panicked any, err error) {
	t.Helper()
	vars := map[string]string{
		"ONCEFLOW_REDIS_URL":    redisURL,
		"ONCEFLOW_DATABASE_URL": testenv.DatabaseURL(t),
		"ONCEFLOW_API_KEYS":     "acme:key-acme-0123456789",
		"ONCEFLOW_HTTP_ADDR":    fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)),
		"ONCEFLOW_LOG_FORMAT":   "text",
	}
	return serveWithEnv(t, vars)
}

// serveWithEnv runs `onceflow serve` (notesApp) with vars as its environment and a
// cancelled context: a command that gets past its configuration stops at once.
func serveWithEnv(t *testing.T, vars map[string]string) (stderr string, panicked any, err error) {
	t.Helper()
	var out, errs bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a command that gets past its configuration stops at once
	func() {
		defer func() { panicked = recover() }()
		err = cli.Run(ctx, notesApp, []string{"serve"}, &out, &errs, func(k string) string { return vars[k] })
	}()
	return errs.String() + out.String(), panicked, err
}

// `onceflow serve` with ONCEFLOW_REDIS_URL naming Sentinels (master_name) exits with a
// configuration error naming ONCEFLOW_REDIS_URL for every URL it cannot use, never a
// panic, and neither password (the sentinels' nor the primary's) in the error or the
// output.
func TestServeWithASentinelURL(t *testing.T) {
	t.Parallel()
	// go-redis's NewFailoverClient panics on route_by_latency=true.
	t.Run("route_by_latency is a config error, not a panic", func(t *testing.T) {
		stderr, p, err := serveWithRedisURL(t, "redis://:sentpw@127.0.0.1:1?master_name=m&route_by_latency=true&password=primpw")
		if p != nil {
			t.Fatalf("serve panicked: %v", p)
		}
		if err == nil || !strings.Contains(err.Error(), "ONCEFLOW_REDIS_URL") {
			t.Fatalf("err = %v, want a config error naming ONCEFLOW_REDIS_URL", err)
		}
		if s := err.Error() + stderr; strings.Contains(s, "sentpw") || strings.Contains(s, "primpw") {
			t.Fatalf("output leaks a password: %s", s)
		}
	})
	t.Run("a malformed one is a config error", func(t *testing.T) {
		for _, u := range []string{
			"redis://:sentpw@127.0.0.1:1?master_name=&password=primpw",
			"redis://:sentpw@127.0.0.1:1?master_name=m&addr=nohostport&password=primpw",
			"redis://:sentpw@127.0.0.1:1?master_name=m&bogus=1&password=primpw",
			"redis://:sentpw@127.0.0.1:1?master_name=m&pool_size=x&password=primpw",
		} {
			stderr, p, err := serveWithRedisURL(t, u)
			if p != nil {
				t.Errorf("%s: panicked: %v", u, p)
				continue
			}
			if err == nil || !strings.Contains(err.Error(), "ONCEFLOW_REDIS_URL") {
				t.Errorf("%s: err = %v, want a config error naming ONCEFLOW_REDIS_URL", u, err)
			}
			if s := fmt.Sprint(err) + stderr; strings.Contains(s, "sentpw") || strings.Contains(s, "primpw") {
				t.Errorf("%s: output leaks a password: %s", u, s)
			}
		}
	})
	// CheckRedis on the failover client, as for a plain URL.
	t.Run("max_retries=3 is refused", func(t *testing.T) {
		stderr, p, err := serveWithRedisURL(t, "redis://:sentpw@127.0.0.1:1?master_name=m&max_retries=3&password=primpw")
		if p != nil {
			t.Fatalf("serve panicked: %v", p)
		}
		if err == nil || !strings.Contains(err.Error(), "MaxRetries") {
			t.Fatalf("err = %v, want MaxRetries refused; stderr %s", err, stderr)
		}
		if s := fmt.Sprint(err) + stderr; strings.Contains(s, "sentpw") || strings.Contains(s, "primpw") {
			t.Fatalf("output leaks a password: %s", s)
		}
	})
	// The cluster URL takes the Redis URL's query (master_name, password=).
	t.Run("with ONCEFLOW_REDIS_CLUSTER_ADDRS is a config error", func(t *testing.T) {
		vars := map[string]string{
			"ONCEFLOW_REDIS_URL":           "redis://:sentpw@127.0.0.1:1?master_name=m&password=primpw",
			"ONCEFLOW_REDIS_CLUSTER_ADDRS": "127.0.0.1:2",
			"ONCEFLOW_DATABASE_URL":        testenv.DatabaseURL(t),
			"ONCEFLOW_API_KEYS":            "acme:key-acme-0123456789",
			"ONCEFLOW_HTTP_ADDR":           fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)),
		}
		stderr, p, err := serveWithEnv(t, vars)
		if p != nil {
			t.Fatalf("panicked: %v", p)
		}
		if err == nil {
			t.Fatalf("serve accepted a Sentinel URL together with cluster seeds; stderr %s", stderr)
		}
		if s := err.Error() + stderr; strings.Contains(s, "sentpw") || strings.Contains(s, "primpw") {
			t.Fatalf("output leaks a password: %s", s)
		}
		t.Logf("error: %v", err)
	})
}
