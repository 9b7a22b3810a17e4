package testenv

import (
	"testing"
	"time"
)

// WaitFor polls cond every 10ms until it holds, failing the test with what after timeout.
// Tests wait for effects this way rather than sleeping a fixed time.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
