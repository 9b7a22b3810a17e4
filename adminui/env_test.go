package adminui_test

// The UI tests' own helpers, beside the kit they share with the lab (adminuitest).

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// serveLogged is adminuitest.Serve with the UI's log captured in buf as well.
func serveLogged(t *testing.T, c *onceflow.Client, rdb *redis.Client, cfg adminui.Config, buf *testenv.SyncBuffer) *adminuitest.Env {
	t.Helper()
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(buf, testenv.Writer(t)), &slog.HandlerOptions{Level: slog.LevelDebug}))
	return adminuitest.Serve(t, c, rdb, cfg)
}

// cookieOf returns the value of c's cookie name for the UI at base ("" for none).
func cookieOf(t *testing.T, c *http.Client, base, name string) string {
	t.Helper()
	u, _ := url.Parse(base + "/ui/")
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == name {
			return ck.Value
		}
	}
	return ""
}

// try is post/get that tolerates a transport error (a server that closes an oversized
// request's connection); status 0 then.
func try(c *http.Client, method, u string, body io.Reader, header ...string) (int, http.Header, string) {
	req, _ := http.NewRequest(method, u, body)
	if body != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// signedIn returns a browser signed in with the admin key, and its CSRF token.
func signedIn(t *testing.T, e *adminuitest.Env) (*http.Client, string) {
	t.Helper()
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatalf("sign-in: %d", code)
	}
	_, page := adminuitest.Get(t, c, e.URL+"/ui/dead-letters")
	return c, adminuitest.CSRF(t, page)
}

// deadCount returns how many dead letters e's queue holds.
func deadCount(e *adminuitest.Env) int64 {
	return e.Redis.XLen(context.Background(), e.Keys.Dead()).Val()
}

// privateRedisEnv is a UI whose client's Redis is a server of the test's own (so that
// the test can stop it), through connect.Redis as `onceflow serve` makes it.
func privateRedisEnv(t *testing.T, buf *testenv.SyncBuffer) (*adminuitest.Env, *testenv.Server) {
	t.Helper()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	pool, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: testenv.Prefix(t), Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	return serveLogged(t, c, rdb, adminui.Config{}, buf), srv
}
