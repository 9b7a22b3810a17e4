package connect_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

func TestRedisOptionsDefaults(t *testing.T) {
	opt, err := connect.RedisOptions("redis://127.0.0.1:16379/0")
	if err != nil {
		t.Fatal(err)
	}
	if !opt.ContextTimeoutEnabled || opt.MaxRetries != -1 || opt.DialTimeout != connect.DefaultRedisDialTimeout {
		t.Fatalf("options %+v", opt)
	}
	opt, err = connect.RedisOptions("redis://127.0.0.1:16379/0?max_retries=2&dial_timeout=7s")
	if err != nil {
		t.Fatal(err)
	}
	if opt.MaxRetries != 2 || opt.DialTimeout != 7*time.Second {
		t.Fatalf("URL options not kept: retries %d dial %v", opt.MaxRetries, opt.DialTimeout)
	}
	_, err = connect.RedisOptions("redis://:hunter2secret@127.0.0.1:16379/notadb")
	if err == nil || strings.Contains(err.Error(), "hunter2secret") {
		t.Fatalf("bad URL error %v leaks the password or is missing", err)
	}
}

// ContextTimeoutEnabled: a context deadline bounds a blocking read even when the
// command itself would block longer.
func TestRedisContextDeadlineBoundsBlockingRead(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := rdb.BLPop(ctx, 10*time.Second, prefix+":empty").Err()
	// go-redis turns the context deadline into the socket's read deadline, so the error
	// is a net timeout rather than context.DeadlineExceeded.
	var ne net.Error
	if !errors.Is(err, context.DeadlineExceeded) && !(errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("BLPOP error = %v, want a timeout", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("BLPOP returned after %v despite a 200ms context", took)
	}
}

func TestPostgresPoolSize(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := connect.Postgres(ctx, testenv.DatabaseURL(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if got := pool.Config().MaxConns; got != connect.DefaultPostgresMaxConns {
		t.Fatalf("MaxConns = %d", got)
	}
	if err := pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}
