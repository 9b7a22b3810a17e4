package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

func TestIsAmbiguousWhenTheProviderMayHaveProcessedTheCall(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"429", &llm.APIError{StatusCode: 429}, false},
		{"500", &llm.APIError{StatusCode: 500}, false},
		{"400", &llm.APIError{StatusCode: 400}, false},
		{"502 from a proxy", &llm.APIError{StatusCode: 502}, true},
		{"504 from a proxy", &llm.APIError{StatusCode: 504}, true},
		{"stream error event", &llm.APIError{StatusCode: 200, Type: "server_error"}, false},
		{"malformed answer", llm.Malformed("openai", "", errors.New("bad")), false},
		{"permanent before sending", retry.Permanent(errors.New("unknown role")), false},
		{"put off before sending", &retry.WaitError{Delay: time.Second, Reason: "model paused"}, false},
		{"429 the limiter made a wait", &retry.WaitError{Delay: time.Second, Err: &llm.APIError{StatusCode: 429}}, false},
		{"504 inside a wait", &retry.WaitError{Delay: time.Second, Err: &llm.APIError{StatusCode: 504}}, true},
		{"per-call timeout", &retry.AttemptTimeoutError{Err: context.DeadlineExceeded}, true},
		{"canceled", fmt.Errorf("openai: %w", context.Canceled), true},
		{"reset", &url.Error{Op: "Post", Err: &net.OpError{Op: "read", Err: syscall.ECONNRESET}}, true},
		{"truncated", fmt.Errorf("openai: %w", io.ErrUnexpectedEOF), true},
		{"refused", &url.Error{Op: "Post", Err: &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}}, false},
		{"dns", &url.Error{Op: "Post", Err: &net.DNSError{Err: "no such host"}}, false},
		{"dial timeout", &url.Error{Op: "Post", Err: &net.OpError{Op: "dial", Err: context.DeadlineExceeded}}, false},
		{"in flight", &ledger.InFlightError{}, false},
		// HTTP/2: the request was sent on a stream; only the server's word that it did
		// not process it (REFUSED_STREAM, a GOAWAY below the stream) makes it clear.
		{"h2 RST_STREAM INTERNAL_ERROR", &url.Error{Op: "Post", Err: http2.StreamError{StreamID: 1, Code: http2.ErrCodeInternal, Cause: errors.New("received from peer")}}, true},
		{"h2 RST_STREAM REFUSED_STREAM", &url.Error{Op: "Post", Err: http2.StreamError{StreamID: 1, Code: http2.ErrCodeRefusedStream, Cause: errors.New("received from peer")}}, false},
		{"h2 GOAWAY below the stream", fmt.Errorf("openai: %w", &url.Error{Op: "Post", Err: errors.New("http2: Transport received GOAWAY from server ErrCode:INTERNAL_ERROR")}), false},
		{"h2 GOAWAY covering the stream", &url.Error{Op: "Post", Err: errors.New(`http2: server sent GOAWAY and closed the connection; LastStreamID=1, ErrCode=NO_ERROR, debug=""`)}, true},
		{"h2 connection lost", &url.Error{Op: "Post", Err: errors.New("http2: client connection lost")}, true},
		{"unknown", errors.New("something"), true},
	} {
		if got := ledger.IsAmbiguous(tc.err); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
