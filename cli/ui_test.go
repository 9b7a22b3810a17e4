package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// serve mounts the operator UI under /ui/ when ONCEFLOW_ADMIN_KEYS is set, and not
// otherwise; the admin key never reaches the logs.
func TestServeMountsTheUIOnlyWithAdminKeys(t *testing.T) {
	t.Parallel()
	bin := testenv.Binary(t)
	_, dsn := testenv.Postgres(t)
	const admin = "admin-key-for-the-cli-test-0123"
	env := []string{"ONCEFLOW_REDIS_URL=" + testenv.RedisURL(t), "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + testenv.Prefix(t),
		"ONCEFLOW_API_KEYS=acme:tenant-key-0123456789abcdef", "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_SHUTDOWN_TIMEOUT=5s"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	get := func(base, path string) (int, string) {
		t.Helper()
		c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := c.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	with := testenv.Start(t, bin, append(append([]string{}, env...), "ONCEFLOW_ADMIN_KEYS="+admin), "serve")
	base := "http://" + fmt.Sprint(with.WaitLog(ctx, "http listening")["addr"])
	if code, body := get(base, "/ui/login"); code != http.StatusOK || !strings.Contains(body, "<h1>Sign in</h1>") {
		t.Fatalf("/ui/login with admin keys: %d %.300s", code, body)
	}
	if code, _ := get(base, "/ui"); code != http.StatusMovedPermanently {
		t.Fatalf("/ui: %d", code)
	}
	without := testenv.Start(t, bin, env, "serve")
	base2 := "http://" + fmt.Sprint(without.WaitLog(ctx, "http listening")["addr"])
	if code, _ := get(base2, "/ui/login"); code != http.StatusNotFound {
		t.Fatalf("/ui/login without admin keys: %d", code)
	}
	with.Signal(syscall.SIGTERM)
	with.Wait(20 * time.Second)
	if strings.Contains(with.Stderr(), admin) || strings.Contains(with.Stdout(), admin) {
		t.Fatal("the admin key is in serve's output")
	}
}
