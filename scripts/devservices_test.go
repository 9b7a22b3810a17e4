// Package scripts holds operator scripts; this test drives scripts/dev-services the way
// a new user does, on ports and folders of its own.
package scripts

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
)

func TestDevServicesUpTwiceDownUpKeepsData(t *testing.T) {
	t.Parallel()
	// A checkout in a 0700 folder, like a clone in root's home: the PostgreSQL user
	// cannot enter it, so the script must keep PostgreSQL's data elsewhere.
	checkout := t.TempDir()
	if err := os.MkdirAll(filepath.Join(checkout, "scripts"), 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("dev-services")
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(checkout, "scripts", "dev-services")
	if err := os.WriteFile(script, src, 0o755); err != nil {
		t.Fatal(err)
	}
	redisPort, pgPort := testenv.FreePort(t), testenv.FreePort(t)
	ds := func(arg string) (string, int) {
		t.Helper()
		// Through bash rather than exec'ing the copy: a fork elsewhere in this test
		// binary may still hold the copy's write descriptor, and exec then fails with
		// "text file busy" (ETXTBSY).
		cmd := exec.Command("bash", script, arg)
		cmd.Env = append(os.Environ(),
			fmt.Sprintf("ONCEFLOW_DEV_REDIS_PORT=%d", redisPort), fmt.Sprintf("ONCEFLOW_DEV_PG_PORT=%d", pgPort))
		out, err := cmd.CombinedOutput()
		code := 0
		if err != nil {
			ee, ok := err.(*exec.ExitError)
			if !ok {
				t.Fatalf("dev-services %s: %v", arg, err)
			}
			code = ee.ExitCode()
		}
		return string(out), code
	}
	t.Cleanup(func() {
		ds("down")
		if home, err := os.ReadFile(filepath.Join(checkout, ".dev", "pg-home")); err == nil && strings.HasPrefix(string(home), "/var/tmp/") {
			_ = os.RemoveAll(strings.TrimSpace(string(home)))
		}
	})

	for i := range 2 {
		if out, code := ds("up"); code != 0 {
			t.Fatalf("up #%d: exit %d\n%s", i+1, code, out)
		}
	}
	out, code := ds("status")
	if code != 0 || !strings.Contains(out, "redis:    running") || !strings.Contains(out, "postgres: running") {
		t.Fatalf("status after up: exit %d\n%s", code, out)
	}
	if os.Geteuid() == 0 && !strings.Contains(out, "/var/tmp/onceflow-dev-") {
		t.Errorf("status does not name where PostgreSQL keeps its data outside the 0700 checkout:\n%s", out)
	}
	envOut, _ := ds("env")
	redisURL := exportValue(t, envOut, "ONCEFLOW_REDIS_URL")
	dbURL := exportValue(t, envOut, "ONCEFLOW_DATABASE_URL")
	if redisURL != fmt.Sprintf("redis://127.0.0.1:%d/0", redisPort) ||
		dbURL != fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/onceflow?sslmode=disable", pgPort) {
		t.Fatalf("env printed %q", envOut)
	}

	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", redisPort)})
	defer rdb.Close()
	if err := rdb.Set(ctx, "kept", "yes", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got := rdb.ConfigGet(ctx, "appendfsync").Val()["appendfsync"]; got != "always" {
		t.Errorf("appendfsync = %q, want always", got)
	}
	execSQL(t, dbURL, "CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)")

	if out, code := ds("down"); code != 0 {
		t.Fatalf("down: exit %d\n%s", code, out)
	}
	if out, code := ds("status"); code == 0 || !strings.Contains(out, "stopped") {
		t.Fatalf("status after down: exit %d\n%s", code, out)
	}
	if out, code := ds("down"); code != 0 {
		t.Fatalf("second down: exit %d\n%s", code, out)
	}
	if out, code := ds("up"); code != 0 {
		t.Fatalf("up after down: exit %d\n%s", code, out)
	}
	if got := rdb.Get(ctx, "kept").Val(); got != "yes" {
		t.Errorf("redis lost its data across down/up: %q", got)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var x int
	if err := conn.QueryRow(ctx, "SELECT x FROM kept").Scan(&x); err != nil || x != 42 {
		t.Errorf("postgres lost its data across down/up: %d %v", x, err)
	}
}

func TestDevServicesRejectsBadPortAndUsage(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("./dev-services", "up")
	cmd.Env = append(os.Environ(), "ONCEFLOW_DEV_REDIS_PORT=abc")
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), `invalid ONCEFLOW_DEV_REDIS_PORT="abc"`) {
		t.Fatalf("bad port: %v\n%s", err, out)
	}
	out, err = exec.Command("./dev-services", "sideways").CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), "usage:") {
		t.Fatalf("bad usage: %v\n%s", err, out)
	}
}

func TestDevServicesReportsAPortInUse(t *testing.T) {
	t.Parallel()
	// Another program (the shared test Redis) holds the port: `up` must say so in one line.
	u := strings.TrimPrefix(testenv.RedisURL(t), "redis://127.0.0.1:")
	port := strings.SplitN(u, "/", 2)[0]
	checkout := t.TempDir()
	_ = os.MkdirAll(filepath.Join(checkout, "scripts"), 0o755)
	src, _ := os.ReadFile("dev-services")
	script := filepath.Join(checkout, "scripts", "dev-services")
	_ = os.WriteFile(script, src, 0o755)
	// Run through bash, not exec'd: a fork of a parallel test may still hold the file
	// open for writing, and exec then fails with "text file busy".
	cmd := exec.Command("bash", script, "up")
	cmd.Env = append(os.Environ(), "ONCEFLOW_DEV_REDIS_PORT="+port, fmt.Sprintf("ONCEFLOW_DEV_PG_PORT=%d", testenv.FreePort(t)))
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "port "+port+" is in use by another program") || !strings.Contains(string(out), "redis.log") {
		t.Fatalf("port in use: %v\n%s", err, out)
	}
}

func exportValue(t *testing.T, out, name string) string {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, "export "+name+"="); ok {
			return strings.Trim(v, "'")
		}
	}
	t.Fatalf("no export of %s in %q", name, out)
	return ""
}

func execSQL(t *testing.T, url, sql string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatal(err)
	}
}
