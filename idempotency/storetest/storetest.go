// Package storetest is the conformance suite every idempotency.Store implementation
// passes: the semantics the middleware relies on, checked against the real backend.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
)

// Run runs the suite. newStore returns an empty store of the test's own (isolated from
// other tests, for example by a key prefix); it is called once per subtest.
func Run(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	t.Run("ClaimCompleteReplay", func(t *testing.T) { t.Parallel(); claimCompleteReplay(t, newStore(t)) })
	t.Run("InProgressAndReused", func(t *testing.T) { t.Parallel(); inProgressAndReused(t, newStore(t)) })
	t.Run("ReleaseFreesKey", func(t *testing.T) { t.Parallel(); releaseFreesKey(t, newStore(t)) })
	t.Run("StaleLockCannotWrite", func(t *testing.T) { t.Parallel(); staleLockCannotWrite(t, newStore(t)) })
	t.Run("LockExpires", func(t *testing.T) { t.Parallel(); lockExpires(t, newStore(t)) })
	t.Run("ResultExpires", func(t *testing.T) { t.Parallel(); resultExpires(t, newStore(t)) })
	t.Run("ConcurrentClaimsOneWinner", func(t *testing.T) { t.Parallel(); concurrentClaims(t, newStore(t)) })
	t.Run("ScopesAreIndependent", func(t *testing.T) { t.Parallel(); scopesIndependent(t, newStore(t)) })
	t.Run("BinaryResponseRoundTrip", func(t *testing.T) { t.Parallel(); binaryRoundTrip(t, newStore(t)) })
}

const (
	fpA = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	fpB = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

var scope = idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/v1/things", Key: "key-0123456789abcdef"}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func mustClaim(t *testing.T, s idempotency.Store, sc idempotency.Scope, fp string, ttl time.Duration) *idempotency.Lock {
	t.Helper()
	lock, stored, err := s.Claim(ctx(t), sc, fp, ttl)
	if err != nil || lock == nil || stored != nil {
		t.Fatalf("Claim of a free key = (%v, %v, %v), want a lock", lock, stored, err)
	}
	return lock
}

// eventually polls f until it reports true, failing after a generous deadline.
func eventually(t *testing.T, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not happen within 20s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func claimCompleteReplay(t *testing.T, s idempotency.Store) {
	lock := mustClaim(t, s, scope, fpA, time.Minute)
	want := &idempotency.Response{
		Status: 201,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/things/1"}},
		Body:   []byte(`{"id":1}`),
	}
	if err := s.Complete(ctx(t), lock, want, time.Hour); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	for range 2 {
		lock, got, err := s.Claim(ctx(t), scope, fpA, time.Minute)
		if err != nil || lock != nil {
			t.Fatalf("Claim of a completed key = (%v, %v), want the stored response", lock, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("stored response = %+v, want %+v", got, want)
		}
	}
	if _, _, err := s.Claim(ctx(t), scope, fpB, time.Minute); !errors.Is(err, idempotency.ErrKeyReused) {
		t.Fatalf("Claim with another fingerprint after completion: %v, want ErrKeyReused", err)
	}
	if err := s.Complete(ctx(t), lock, want, time.Hour); !errors.Is(err, idempotency.ErrLockLost) {
		t.Fatalf("second Complete with the same lock: %v, want ErrLockLost", err)
	}
}

func inProgressAndReused(t *testing.T, s idempotency.Store) {
	mustClaim(t, s, scope, fpA, time.Minute)
	if _, _, err := s.Claim(ctx(t), scope, fpA, time.Minute); !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("Claim while in progress: %v, want ErrInProgress", err)
	}
	if _, _, err := s.Claim(ctx(t), scope, fpB, time.Minute); !errors.Is(err, idempotency.ErrKeyReused) {
		t.Fatalf("Claim with another fingerprint while in progress: %v, want ErrKeyReused", err)
	}
}

func releaseFreesKey(t *testing.T, s idempotency.Store) {
	lock := mustClaim(t, s, scope, fpA, time.Minute)
	if err := s.Release(ctx(t), lock); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := s.Release(ctx(t), lock); !errors.Is(err, idempotency.ErrLockLost) {
		t.Fatalf("second Release: %v, want ErrLockLost", err)
	}
	// After a release any request may claim again, even with another body.
	mustClaim(t, s, scope, fpB, time.Minute)
}

func staleLockCannotWrite(t *testing.T, s idempotency.Store) {
	old := mustClaim(t, s, scope, fpA, time.Minute)
	if err := s.Release(ctx(t), old); err != nil {
		t.Fatal(err)
	}
	newer := mustClaim(t, s, scope, fpA, time.Minute)
	if err := s.Complete(ctx(t), old, &idempotency.Response{Status: 200, Body: []byte("old")}, time.Hour); !errors.Is(err, idempotency.ErrLockLost) {
		t.Fatalf("Complete with a stale lock: %v, want ErrLockLost", err)
	}
	if err := s.Release(ctx(t), old); !errors.Is(err, idempotency.ErrLockLost) {
		t.Fatalf("Release with a stale lock: %v, want ErrLockLost", err)
	}
	// The newer lock is intact.
	if err := s.Complete(ctx(t), newer, &idempotency.Response{Status: 200, Body: []byte("new")}, time.Hour); err != nil {
		t.Fatalf("Complete with the current lock: %v", err)
	}
	_, got, err := s.Claim(ctx(t), scope, fpA, time.Minute)
	if err != nil || got == nil || string(got.Body) != "new" {
		t.Fatalf("stored = (%+v, %v), want the newer request's response", got, err)
	}
}

func lockExpires(t *testing.T, s idempotency.Store) {
	old := mustClaim(t, s, scope, fpA, 50*time.Millisecond)
	var newer *idempotency.Lock
	eventually(t, "lock expiry", func() bool {
		l, _, err := s.Claim(ctx(t), scope, fpA, time.Minute)
		if err != nil && !errors.Is(err, idempotency.ErrInProgress) {
			t.Fatalf("Claim: %v", err)
		}
		newer = l
		return l != nil
	})
	if newer.Token == old.Token {
		t.Fatal("a new claim reused the old token")
	}
	if err := s.Complete(ctx(t), old, &idempotency.Response{Status: 200}, time.Hour); !errors.Is(err, idempotency.ErrLockLost) {
		t.Fatalf("Complete after the lock expired: %v, want ErrLockLost", err)
	}
}

func resultExpires(t *testing.T, s idempotency.Store) {
	lock := mustClaim(t, s, scope, fpA, time.Minute)
	if err := s.Complete(ctx(t), lock, &idempotency.Response{Status: 200}, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	eventually(t, "result expiry", func() bool {
		l, stored, err := s.Claim(ctx(t), scope, fpB, time.Minute)
		if err != nil && !errors.Is(err, idempotency.ErrKeyReused) {
			t.Fatalf("Claim: %v", err)
		}
		if l == nil && stored != nil {
			t.Fatal("another fingerprint got the stored response")
		}
		return l != nil
	})
}

func concurrentClaims(t *testing.T, s idempotency.Store) {
	const n = 50
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		locks   int
		waiting int
	)
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			l, _, err := s.Claim(ctx(t), scope, fpA, time.Minute)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case l != nil:
				locks++
			case errors.Is(err, idempotency.ErrInProgress):
				waiting++
			default:
				t.Errorf("Claim: %v", err)
			}
		})
	}
	close(start)
	wg.Wait()
	if locks != 1 || waiting != n-1 {
		t.Fatalf("%d claims won and %d saw in-progress, want 1 and %d", locks, waiting, n-1)
	}
}

func scopesIndependent(t *testing.T, s idempotency.Store) {
	others := []idempotency.Scope{
		{Tenant: "other", Method: scope.Method, Path: scope.Path, Key: scope.Key},
		{Tenant: scope.Tenant, Method: "PATCH", Path: scope.Path, Key: scope.Key},
		{Tenant: scope.Tenant, Method: scope.Method, Path: "/v1/others", Key: scope.Key},
		{Tenant: scope.Tenant, Method: scope.Method, Path: scope.Path, Key: scope.Key + "x"},
	}
	lock := mustClaim(t, s, scope, fpA, time.Minute)
	if err := s.Complete(ctx(t), lock, &idempotency.Response{Status: 200, Body: []byte("first")}, time.Hour); err != nil {
		t.Fatal(err)
	}
	for _, o := range others {
		// A different body too: no 422 across scopes.
		mustClaim(t, s, o, fpB, time.Minute)
	}
}

func binaryRoundTrip(t *testing.T, s idempotency.Store) {
	body := make([]byte, 512)
	for i := range body {
		body[i] = byte(i)
	}
	body = append(body, "\nP"+fpA+"\n"...) // looks like a record: must not confuse the store
	cases := []*idempotency.Response{
		{Status: 200, Header: http.Header{}, Body: body},
		{Status: 204, Header: http.Header{}},
		{Status: 201, Header: http.Header{"Location": {"/x"}}, Truncated: true},
	}
	for i, want := range cases {
		sc := scope
		sc.Key = scope.Key + string(rune('a'+i))
		lock := mustClaim(t, s, sc, fpA, time.Minute)
		if err := s.Complete(ctx(t), lock, want, time.Hour); err != nil {
			t.Fatal(err)
		}
		_, got, err := s.Claim(ctx(t), sc, fpA, time.Minute)
		if err != nil || got == nil {
			t.Fatalf("case %d: Claim = (%v, %v)", i, got, err)
		}
		if got.Status != want.Status || !bytes.Equal(got.Body, want.Body) || got.Truncated != want.Truncated || !reflect.DeepEqual(got.Header, want.Header) {
			t.Fatalf("case %d: stored %+v, want %+v", i, got, want)
		}
	}
}
