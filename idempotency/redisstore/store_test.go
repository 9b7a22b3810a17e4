package redisstore

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/storetest"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

func newTestStore(t *testing.T, cfg Config) (*Store, *roundtrip.Counter) {
	t.Helper()
	rdb, prefix := testenv.QueueRedis(t)
	var c roundtrip.Counter
	rdb.AddHook(&c)
	cfg.Prefix = prefix
	s, err := New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Preload(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.Reset()
	return s, &c
}

func TestRedisStorePassesTheStoreConformanceSuite(t *testing.T) {
	t.Parallel()
	storetest.Run(t, func(t *testing.T) idempotency.Store {
		s, _ := newTestStore(t, Config{})
		return s
	})
}

func TestConformanceWithHashTag(t *testing.T) {
	t.Parallel()
	storetest.Run(t, func(t *testing.T) idempotency.Store {
		s, _ := newTestStore(t, Config{HashTag: "things"})
		return s
	})
}

var testScope = idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/things", Key: "client-key-0123456789"}

const testFP = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// TestRoundTrips proves the generic path's cost: an accepted request is two round trips
// (claim, complete), a replay one, a 409 or 422 one, a released request two.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	s, c := newTestStore(t, Config{})
	ctx := context.Background()
	count := func(what string, want int64, f func()) {
		t.Helper()
		c.Reset()
		f()
		if got := c.Redis(); got != want {
			t.Errorf("%s: %d Redis round trips, want %d", what, got, want)
		}
	}
	var lock *idempotency.Lock
	count("accepted request (claim + complete)", 2, func() {
		var err error
		if lock, _, err = s.Claim(ctx, testScope, testFP, time.Minute); err != nil || lock == nil {
			t.Fatalf("Claim: %v", err)
		}
		if err := s.Complete(ctx, lock, &idempotency.Response{Status: 201}, time.Hour); err != nil {
			t.Fatal(err)
		}
	})
	count("replay", 1, func() {
		if _, stored, err := s.Claim(ctx, testScope, testFP, time.Minute); err != nil || stored == nil {
			t.Fatalf("Claim: %v", err)
		}
	})
	count("422", 1, func() {
		if _, _, err := s.Claim(ctx, testScope, strings.Repeat("f", 64), time.Minute); !errors.Is(err, idempotency.ErrKeyReused) {
			t.Fatalf("Claim: %v", err)
		}
	})
	other := testScope
	other.Key += "-2"
	count("released request (claim + release)", 2, func() {
		l, _, err := s.Claim(ctx, other, testFP, time.Minute)
		if err != nil || l == nil {
			t.Fatalf("Claim: %v", err)
		}
		if err := s.Release(ctx, l); err != nil {
			t.Fatal(err)
		}
	})
	count("409", 1, func() {
		if _, _, err := s.Claim(ctx, other, testFP, time.Minute); err != nil {
			t.Fatal(err)
		}
		c.Reset()
		if _, _, err := s.Claim(ctx, other, testFP, time.Minute); !errors.Is(err, idempotency.ErrInProgress) {
			t.Fatalf("Claim: %v", err)
		}
	})
}

// TestKeysArePrefixedAndHashed checks the key layout: the prefix and a colon first, the
// scope only as a SHA-256, never the raw client key or tenant.
func TestKeysArePrefixedAndHashed(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	s, err := New(rdb, Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, _, err := s.Claim(ctx, testScope, testFP, time.Minute); err != nil {
		t.Fatal(err)
	}
	keys, err := rdb.Keys(ctx, prefix+":*").Result()
	if err != nil {
		t.Fatal(err)
	}
	want := prefix + ":idem:" + testScope.Hash()
	if len(keys) != 1 || keys[0] != want {
		t.Fatalf("keys = %v, want [%s]", keys, want)
	}
	v, _ := rdb.Get(ctx, want).Result()
	for _, secret := range []string{testScope.Key, testScope.Tenant} {
		if strings.Contains(keys[0], secret) || strings.Contains(v, secret) {
			t.Errorf("key or value contains %q", secret)
		}
	}
	if got := s.Key(testScope); got != want {
		t.Errorf("Key = %s, want %s", got, want)
	}
	tagged, _ := New(rdb, Config{Prefix: prefix, HashTag: "summaries"})
	if got := tagged.Key(testScope); got != prefix+":{summaries}:idem:"+testScope.Hash() {
		t.Errorf("tagged Key = %s", got)
	}
}

// TestRedisDownIsAnError checks that an unreachable Redis surfaces as an error that is
// none of the semantic ones (the middleware answers 503), within the caller's deadline.
func TestRedisDownIsAnError(t *testing.T) {
	t.Parallel()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	s, err := New(rdb, Config{Prefix: "down"})
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	lock, stored, err := s.Claim(ctx, testScope, testFP, time.Minute)
	if err == nil || lock != nil || stored != nil {
		t.Fatalf("Claim with Redis down = (%v, %v, %v), want an error", lock, stored, err)
	}
	for _, sem := range []error{idempotency.ErrInProgress, idempotency.ErrKeyReused, idempotency.ErrLockLost} {
		if errors.Is(err, sem) {
			t.Fatalf("Redis down reported as %v", sem)
		}
	}
}

// TestCorruptRecordIsAnError: a value the store did not write is reported, not
// misread as a replay.
func TestCorruptRecordIsAnError(t *testing.T) {
	t.Parallel()
	s, _ := newTestStore(t, Config{})
	ctx := context.Background()
	if err := s.rdb.Set(ctx, s.Key(testScope), "garbage", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if _, stored, err := s.Claim(ctx, testScope, testFP, time.Minute); !errors.Is(err, errCorrupt) || stored != nil {
		t.Fatalf("Claim of a corrupt record = (%v, %v), want errCorrupt", stored, err)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	rdb, _ := testenv.Redis(t)
	for _, cfg := range []Config{{Prefix: "a{b}"}, {HashTag: "x}"}, {ResultTTL: time.Microsecond}} {
		if _, err := New(rdb, cfg); err == nil {
			t.Errorf("New(%+v) succeeded", cfg)
		}
	}
	if _, err := New(nil, Config{}); err == nil {
		t.Error("New(nil) succeeded")
	}
}

func TestRecordRoundTrip(t *testing.T) {
	resp := &idempotency.Response{Status: 202, Header: http.Header{"Location": {"/v1/x"}}, Body: []byte("a\nb\x00c")}
	b, err := encodeDone(testFP, resp)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := decodeRecord(string(b))
	if err != nil || rec.state != stateDone || rec.fingerprint != testFP {
		t.Fatalf("decode = (%+v, %v)", rec, err)
	}
	if rec.resp.Status != 202 || string(rec.resp.Body) != "a\nb\x00c" || rec.resp.Header.Get("Location") != "/v1/x" {
		t.Fatalf("decoded response %+v", rec.resp)
	}
	m, err := decodeRecord(encodeMarker(testFP, "tok"))
	if err != nil || m.state != stateInProgress || m.token != "tok" || m.fingerprint != testFP {
		t.Fatalf("decode marker = (%+v, %v)", m, err)
	}
	for _, bad := range []string{"", "D", "Dfp", "X" + testFP + "\n", "D" + testFP + "\n{}", "D" + testFP + "\n{\"status\":7}\n", "\n\n"} {
		if _, err := decodeRecord(bad); !errors.Is(err, errCorrupt) {
			t.Errorf("decodeRecord(%q) = %v, want errCorrupt", bad, err)
		}
	}
}

// FuzzDecodeRecord: decoding whatever Redis holds never panics, and every record that
// decodes as done re-encodes to a record that decodes to the same response.
func FuzzDecodeRecord(f *testing.F) {
	done, _ := encodeDone(testFP, &idempotency.Response{Status: 201, Header: http.Header{"Location": {"/a"}}, Body: []byte("{}")})
	f.Add(string(done))
	f.Add(encodeMarker(testFP, "token"))
	f.Add("D" + testFP + "\n{\"status\":200,\"truncated\":true}\n")
	f.Add("garbage")
	f.Fuzz(func(t *testing.T, v string) {
		rec, err := decodeRecord(v)
		if err != nil || rec.state != stateDone {
			return
		}
		if checkFingerprint(rec.fingerprint) != nil {
			return
		}
		b, err := encodeDone(rec.fingerprint, rec.resp)
		if err != nil {
			t.Fatalf("re-encode %+v: %v", rec.resp, err)
		}
		again, err := decodeRecord(string(b))
		if err != nil || again.fingerprint != rec.fingerprint || again.resp.Status != rec.resp.Status ||
			string(again.resp.Body) != string(rec.resp.Body) || again.resp.Truncated != rec.resp.Truncated {
			t.Fatalf("round trip changed the record: %+v / %+v (%v)", rec.resp, again.resp, err)
		}
	})
}
