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

// A store stops under `onceflow work`: its breaker opens after ONCEFLOW_BREAKER_THRESHOLD
// failing health checks, /readyz names it "unavailable since <RFC 3339>: <why>" and
// /metrics exports onceflow_breaker_open{dependency} 1 with the time it opened; once
// the store is back the first passing check closes it, and both say so. (Before the
// store breakers, /readyz only said that a ping failed, and the metrics had no series
// for redis or postgres.)
func TestWorkReportsAnOpenStoreBreakerSince(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	run := func(t *testing.T, srv *testenv.Server, down, up string, env []string) {
		t.Helper()
		// A prefix of its own: on the shared Redis, the default prefix's queue may hold
		// other tests' jobs, and a job that fails on the stopped PostgreSQL trips the
		// breaker before the health check does (seen once in `go test ./cli`).
		env = append(env, "ONCEFLOW_PREFIX="+testenv.Prefix(t), "ONCEFLOW_METRICS_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
			"ONCEFLOW_HEALTH_INTERVAL=100ms", "ONCEFLOW_BREAKER_THRESHOLD=2")
		p := testenv.Start(t, bin, env, "work")
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		base := "http://" + fmt.Sprint(p.WaitLog(ctx, "http listening")["addr"])
		series := fmt.Sprintf(`onceflow_breaker_open{dependency=%q}`, down)
		awaitReady(t, base)
		if _, metrics := httpGet(t, base+"/metrics", ""); !strings.Contains(metrics, series+" 0") {
			t.Fatalf("/metrics lacks %s 0:\n%s", series, grepLines(metrics, "breaker_open"))
		}

		stopped := time.Now().Add(-time.Second).UTC().Truncate(time.Second)
		srv.Stop()
		var entry string
		testenv.WaitFor(t, 30*time.Second, down+"'s breaker in /readyz", func() bool {
			code, body, _ := getJSON(t, base+"/readyz")
			checks, _ := body["checks"].(map[string]any)
			entry = fmt.Sprint(checks[down])
			return code == http.StatusServiceUnavailable && strings.HasPrefix(entry, "unavailable since ")
		})
		stamp, why, _ := strings.Cut(strings.TrimPrefix(entry, "unavailable since "), ": ")
		since, err := time.Parse(time.RFC3339, stamp)
		if err != nil || since.Before(stopped) || since.After(time.Now()) || !strings.Contains(why, "health check") {
			t.Fatalf("/readyz says %s is %q, want \"unavailable since <the trip, RFC 3339>: health check: ...\"", down, entry)
		}
		code, body, took := getJSON(t, base+"/readyz")
		if checks, _ := body["checks"].(map[string]any); code != http.StatusServiceUnavailable || (up != "" && checks[up] != "ok") || took > 2*time.Second {
			t.Fatalf("readyz with %s down: %d %v in %v, want 503 with %s ok, fast", down, code, body, took, up)
		}
		_, metrics := httpGet(t, base+"/metrics", "")
		sinceSeries := fmt.Sprintf(`onceflow_breaker_open_since_timestamp_seconds{dependency=%q}`, down)
		if !strings.Contains(metrics, series+" 1") || !strings.Contains(metrics, sinceSeries+" 1.") {
			t.Fatalf("/metrics with %s down lacks %s 1 and its open time:\n%s", down, series, grepLines(metrics, "breaker_open"))
		}

		srv.Start()
		testenv.WaitFor(t, 30*time.Second, "readyz after "+down+" restarted", func() bool {
			code, body, _ := getJSON(t, base+"/readyz")
			checks, _ := body["checks"].(map[string]any)
			return code == 200 && checks[down] == "ok"
		})
		if _, metrics := httpGet(t, base+"/metrics", ""); !strings.Contains(metrics, series+" 0") {
			t.Fatalf("/metrics after %s restarted lacks %s 0:\n%s", down, series, grepLines(metrics, "breaker_open"))
		}
	}
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		r := testenv.PrivateRedis(t)
		_, dsn := testenv.Postgres(t)
		run(t, r, "redis", "postgres", []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURLOf(r), "ONCEFLOW_DATABASE_URL=" + dsn})
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		pg, dsn, _ := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
		run(t, pg, "postgres", "redis", []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn})
	})
}
