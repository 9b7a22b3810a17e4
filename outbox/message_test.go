package outbox

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry"
)

func TestPermanentAndRetryAfterAreFoundThroughWrapping(t *testing.T) {
	t.Parallel()
	base := errors.New("bad request")
	p := fmt.Errorf("send: %w", Permanent(base))
	if !IsPermanent(p) || !errors.Is(p, ErrPermanent) || !errors.Is(p, base) || p.Error() != "send: bad request" {
		t.Fatalf("Permanent wrapped: %v", p)
	}
	if IsPermanent(base) || Permanent(nil) != nil {
		t.Fatal("plain error permanent, or Permanent(nil) not nil")
	}
	ra := fmt.Errorf("send: %w", RetryAfter(base, 3*time.Second))
	if d, ok := RetryAfterOf(ra); !ok || d != 3*time.Second || !errors.Is(ra, base) {
		t.Fatalf("RetryAfterOf = %v %v", d, ok)
	}
	if _, ok := RetryAfterOf(base); ok {
		t.Fatal("RetryAfterOf found a delay in a plain error")
	}
	if RetryAfter(base, 0) != base || RetryAfter(nil, time.Second) != nil {
		t.Fatal("RetryAfter with no delay or no error must return err unchanged")
	}
}

// One permanent marker: whoever marked the error (retry, queue or outbox), the relay
// sees it as permanent.
func TestPermanentIsRetryPermanent(t *testing.T) {
	t.Parallel()
	base := errors.New("HTTP 400")
	for _, err := range []error{Permanent(base), retry.Permanent(base)} {
		if !IsPermanent(err) || !errors.Is(err, ErrPermanent) || !retry.IsPermanent(err) || !errors.Is(err, base) {
			t.Fatalf("%v is not permanent everywhere", err)
		}
	}
	if d, ok := RetryAfterOf(retry.RetryAfter(2*time.Second, base)); !ok || d != 2*time.Second {
		t.Fatalf("RetryAfterOf(retry.RetryAfter) = %v %v", d, ok)
	}
}
