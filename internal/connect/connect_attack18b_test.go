package connect_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/connect"
)

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

// Found by the second attack round of issue 18, failed before its fix: a Sentinel URL with route_by_latency=true or route_randomly=true (options
// redis.ParseFailoverURL accepts) makes connect.Redis panic inside
// redis.NewFailoverClient ("to route commands by latency, use
// NewFailoverClusterClient") instead of returning a configuration error. `onceflow
// serve` with such an ONCEFLOW_REDIS_URL crashes with a stack trace.
func TestAttack18bSentinelRoutingOptionsAreAnErrorNotAPanic(t *testing.T) {
	for _, q := range []string{"route_by_latency=true", "route_randomly=true"} {
		url := "redis://127.0.0.1:26379?master_name=mymaster&" + q
		p, err := redisNoPanic(url)
		if p != nil {
			t.Errorf("%s: connect.Redis panicked: %v", q, p)
			continue
		}
		if err == nil {
			t.Errorf("%s: accepted; want an error (the failover client cannot route)", q)
		}
	}
}

// Found by the second attack round of issue 18, failed before its fix: the parse error of a URL whose password holds a '"' or a '\' (characters
// url.Parse rejects in userinfo) echoes the password: net/url quotes the URL with %q,
// so the escaped form differs from the raw URL and strings.ReplaceAll(err, url, "...")
// misses it. Same for sentinel and plain URLs; onceflow.NewRedis callers (library
// users) log the error. (`onceflow serve` is protected: config rejects the URL first
// with "not a URL".)
func TestAttack18bRedisURLParseErrorHidesPassword(t *testing.T) {
	for _, url := range []string{
		`redis://:sec"R3tpw@127.0.0.1:26379?master_name=m`,
		`redis://:sec\R3tpw@127.0.0.1:26379?master_name=m`,
		`redis://127.0.0.1:26379x?master_name=m&password=sec"R3tpw`,
		`redis://:sec"R3tpw@127.0.0.1:6379/0`,
	} {
		p, err := redisNoPanic(url)
		if p != nil {
			t.Errorf("%s: panicked: %v", url, p)
			continue
		}
		if err == nil {
			t.Errorf("%s: accepted", url)
			continue
		}
		if strings.Contains(err.Error(), "R3tpw") {
			t.Errorf("error leaks the password: %v", err)
		}
	}
}

// Guard (second attack round of issue 18): malformed Sentinel URLs are errors (no panic) that hold no secret.
func TestAttack18bMalformedSentinelURLs(t *testing.T) {
	for _, url := range []string{
		"redis://:sentpw@127.0.0.1:26379?master_name=&password=primpw",
		"redis://:sentpw@127.0.0.1:26379?master_name=m&addr=nohostport&password=primpw",
		"redis://:sentpw@127.0.0.1:26379?master_name=m&addr=:26379&password=primpw",
		"redis://:sentpw@127.0.0.1:26379?master_name=m&bogus=1&password=primpw",
		"redis://:sentpw@127.0.0.1:26379/x?master_name=m&password=primpw",
		"redis://:sentpw@127.0.0.1:26379?master_name=m&max_retries=x&password=primpw",
		"unix:///tmp/sentinel.sock?master_name=m&password=primpw",
	} {
		p, err := redisNoPanic(url)
		if p != nil {
			t.Errorf("%s: panicked: %v", url, p)
			continue
		}
		if err == nil {
			t.Errorf("%s: accepted", url)
			continue
		}
		if s := fmt.Sprint(err); strings.Contains(s, "sentpw") || strings.Contains(s, "primpw") {
			t.Errorf("%s: error leaks a password: %v", url, err)
		}
	}
}

// Found by the second attack round of issue 18, failed before its fix: docs/operations.md says a Sentinel URL works with rediss:// for TLS, but
// RedisFailoverOptions keeps go-redis's TLS config whose ServerName is the first
// sentinel's host, and go-redis uses that one config to dial every sentinel (addr=) and
// the primary the sentinels name. A primary (or a second sentinel) whose certificate
// names its own host fails verification; after a failover the new primary too. Either
// clear ServerName per dial (verify against the dialled host) or document the
// limitation (a certificate valid for the first sentinel's name on every node).
func TestAttack18bSentinelTLSServerNameIsNotTheFirstSentinels(t *testing.T) {
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
}
