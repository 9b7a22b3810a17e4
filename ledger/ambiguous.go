package ledger

import (
	"errors"
	"net"
	"net/http"
	"syscall"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// IsAmbiguous reports whether a failed model call may nevertheless have been done (and
// billed) by the provider: the request may have been sent, and no answer says what
// became of it. The "dangerous case" of docs/providers.md. In order:
//
//   - nil: false;
//   - a provider's error answer (*llm.APIError): false, the provider said it failed,
//     except 502 and 504, which a proxy or gateway in front of the provider answers
//     when it lost the upstream call (which may have completed);
//   - permanent errors (a request rejected before it was sent, a malformed answer):
//     false;
//   - a wait (retry.ErrWaiting, a *retry.WaitError around no provider answer): false,
//     the call was put off before it was sent (the limiter below the ledger: a pause
//     set after the call's admission);
//   - failures to connect (refused, DNS, any error while dialling): false, the request
//     never left;
//   - the server said it did not process the request (retry.NotProcessed): an HTTP/2
//     RST_STREAM with REFUSED_STREAM, a GOAWAY whose last-stream-id is below the
//     request's stream (RFC 9113 sections 8.7 and 6.8), a connection that could not
//     take the request: false;
//   - timeouts (the per-call deadline, a net timeout), cancellation, a reset or closed
//     connection, a truncated body or stream (io.ErrUnexpectedEOF), an HTTP/2
//     RST_STREAM with any other code (INTERNAL_ERROR from a provider's edge), a GOAWAY
//     that covered the request, a lost HTTP/2 connection: true, since the request was
//     sent and may have been processed;
//   - anything else: true, since not knowing is exactly the ambiguous case.
//
// It is safe for concurrent use.
func IsAmbiguous(err error) bool {
	if err == nil {
		return false
	}
	var api *llm.APIError
	if errors.As(err, &api) {
		return api.StatusCode == http.StatusBadGateway || api.StatusCode == http.StatusGatewayTimeout
	}
	var ife *InFlightError
	if errors.As(err, &ife) {
		return false
	}
	if retry.IsPermanent(err) || errors.Is(err, retry.ErrWaiting) {
		return false
	}
	if retry.NotProcessed(err) {
		return false // the server refused it before processing: nothing was done
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return false // connecting failed (a deadline while dialling included): nothing was sent
	}
	var dns *net.DNSError
	if errors.As(err, &dns) || errors.Is(err, syscall.ECONNREFUSED) {
		return false
	}
	return true // timeouts, cancellation, resets, truncated answers, the unknown
}
