package onceflow_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
)

func TestPostgresConfigDefaults(t *testing.T) {
	cfg, err := onceflow.PostgresConfig("postgres://u:pw@127.0.0.1:5432/db")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxConns != onceflow.DefaultPostgresMaxConns || cfg.ConnConfig.ConnectTimeout != onceflow.DefaultPostgresConnectTimeout {
		t.Fatalf("max conns %d, connect timeout %v", cfg.MaxConns, cfg.ConnConfig.ConnectTimeout)
	}
	cfg, err = onceflow.PostgresConfig("postgres://u:pw@127.0.0.1:5432/db?pool_max_conns=4&connect_timeout=9")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxConns != 4 || cfg.ConnConfig.ConnectTimeout != 9*time.Second {
		t.Fatalf("URL settings not kept: max conns %d, connect timeout %v", cfg.MaxConns, cfg.ConnConfig.ConnectTimeout)
	}
	_, err = onceflow.PostgresConfig("postgres://u:hunter2secret@127.0.0.1:5432/db?pool_max_conns=many")
	if err == nil || strings.Contains(err.Error(), "hunter2secret") {
		t.Fatalf("bad URL error %v leaks the password or is missing", err)
	}
}

// Every session gets a statement timeout (so a stuck statement cannot hold a job for
// ever), unless the URL sets its own.
func TestPostgresSessionsHaveStatementTimeouts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	show := func(url, setting string) string {
		t.Helper()
		pool, err := onceflow.NewPostgres(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		var v string
		if err := pool.QueryRow(ctx, "SHOW "+setting).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	url := testenv.DatabaseURL(t)
	if got := show(url, "statement_timeout"); got != "30s" {
		t.Errorf("statement_timeout = %q, want 30s", got)
	}
	if got := show(url, "idle_in_transaction_session_timeout"); got != "1min" {
		t.Errorf("idle_in_transaction_session_timeout = %q, want 1min", got)
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	if got := show(url+sep+"statement_timeout=5000", "statement_timeout"); got != "5s" {
		t.Errorf("statement_timeout with the URL's 5000 = %q, want 5s", got)
	}
}

func TestNewPostgresConnects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := onceflow.NewPostgres(ctx, testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if got := pool.Config().MaxConns; got != onceflow.DefaultPostgresMaxConns {
		t.Fatalf("MaxConns = %d", got)
	}
	var one int
	if err := pool.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1 = %d, %v", one, err)
	}
}
