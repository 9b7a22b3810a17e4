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
	t.Parallel()
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

// refused fails the test unless connect.Redis refuses url with an error, not a panic,
// that holds none of secrets.
func refused(t *testing.T, url string, secrets ...string) {
	t.Helper()
	p, err := redisNoPanic(url)
	switch {
	case p != nil:
		t.Errorf("%s: connect.Redis panicked: %v", url, p)
	case err == nil:
		t.Errorf("%s: accepted; want an error", url)
	default:
		for _, secret := range secrets {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("%s: the error leaks %q: %v", url, secret, err)
			}
		}
	}
}

// redisNoPanic calls connect.Redis(url) and turns a panic into an error.
func redisNoPanic(url string) (panicked any, err error) {
	defer func() {
		if r := recover(); r != nil {
			panicked = r
		}
	}()
	rdb, err := connect.Redis(url)
	if rdb != nil {
		_ = rdb.Close()
	}
	return nil, err
}

// The parse error of a URL whose password holds a '"' or a '\' (characters url.Parse
// rejects in userinfo) does not echo the password, although net/url quotes the URL
// with %q (so the escaped form differs from the raw URL), for Sentinel and plain URLs
// alike: onceflow.NewRedis callers log the error.
func TestRedisURLParseErrorHidesThePassword(t *testing.T) {
	t.Parallel()
	for _, url := range []string{
		`redis://:sec"R3tpw@127.0.0.1:26379?master_name=m`,
		`redis://:sec\R3tpw@127.0.0.1:26379?master_name=m`,
		`redis://127.0.0.1:26379x?master_name=m&password=sec"R3tpw`,
		`redis://:sec"R3tpw@127.0.0.1:6379/0`,
	} {
		refused(t, url, "R3tpw")
	}
}

// A Sentinel URL (master_name) is refused with an error, never a panic, for every option
// the failover client cannot honour, holds no secret in its errors, and verifies each
// node it dials over TLS against that node's own name.
func TestSentinelURL(t *testing.T) {
	t.Parallel()
	// route_by_latency=true and route_randomly=true, which redis.ParseFailoverURL accepts,
	// make redis.NewFailoverClient panic ("to route commands by latency, use
	// NewFailoverClusterClient").
	t.Run("routing options are an error, not a panic", func(t *testing.T) {
		for _, q := range []string{"route_by_latency=true", "route_randomly=true"} {
			refused(t, "redis://127.0.0.1:26379?master_name=mymaster&"+q)
		}
	})
	t.Run("a malformed one is an error that holds no secret", func(t *testing.T) {
		for _, url := range []string{
			"redis://:sentpw@127.0.0.1:26379?master_name=&password=primpw",
			"redis://:sentpw@127.0.0.1:26379?master_name=m&addr=nohostport&password=primpw",
			"redis://:sentpw@127.0.0.1:26379?master_name=m&addr=:26379&password=primpw",
			"redis://:sentpw@127.0.0.1:26379?master_name=m&bogus=1&password=primpw",
			"redis://:sentpw@127.0.0.1:26379/x?master_name=m&password=primpw",
			"redis://:sentpw@127.0.0.1:26379?master_name=m&max_retries=x&password=primpw",
			"unix:///tmp/sentinel.sock?master_name=m&password=primpw",
		} {
			refused(t, url, "sentpw", "primpw")
		}
	})
	// go-redis dials every sentinel (addr=) and the primary the sentinels name with one
	// TLS config: its ServerName must not be pinned to the first sentinel's host, or a
	// primary (or a second sentinel) whose certificate names its own host fails
	// verification, and after a failover the new primary too.
	t.Run("TLS verifies each node by its own name, not the first sentinel's", func(t *testing.T) {
		opt, err := connect.RedisFailoverOptions("rediss://sentinel1.internal:26379?addr=sentinel2.internal:26379&master_name=m")
		if err != nil {
			t.Fatal(err)
		}
		if opt.TLSConfig == nil {
			t.Fatal("rediss:// without TLS")
		}
		if opt.TLSConfig.ServerName == "sentinel1.internal" {
			t.Fatalf("TLS ServerName pinned to %q for every sentinel and for the primary", opt.TLSConfig.ServerName)
		}
	})
}
