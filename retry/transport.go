package retry

import (
	"errors"
	"fmt"
	"strings"
)

// This file is the one place that recognises net/http's transport and protocol errors
// that have no exported type: the HTTP/2 client's stream resets, GOAWAYs and lost
// connections, and the HTTP/1 transport's broken and idle-closed connections. net/http
// bundles its HTTP/2 client (h2_bundle.go) with every such type unexported, so:
//
//   - a stream error is matched by shape: net/http's http2StreamError has an As method
//     that fills any struct with its fields (StreamID, Code, Cause), kept so that
//     errors.As works with golang.org/x/net/http2.StreamError; h2StreamError below is
//     such a struct, and no message is parsed;
//   - everything else is matched by the message net/http gives it, as a prefix of the
//     message of one error in the chain (the error net/http created, not a wrapper
//     around it, whose message starts with "openai: Post ..."). The messages are those
//     of Go 1.26's net/http, and of golang.org/x/net/http2 where it has the same error.
//
// The tests in this package and in llm/openai, llm/anthropic and summaries produce these
// errors from real servers (internal/testenv/h2fault), so a Go release that changes one fails
// them instead of silently turning a retryable reset into an unknown error.

// h2StreamError has the shape of net/http's http2StreamError (and x/net's StreamError):
// an HTTP/2 error confined to one stream, either a RST_STREAM received from the server
// (Cause is the sentinel "received from peer") or detected by the client.
type h2StreamError struct {
	StreamID uint32
	Code     uint32
	Cause    error
}

func (e h2StreamError) Error() string {
	return fmt.Sprintf("stream error: stream ID %d; %d", e.StreamID, e.Code)
}

// h2CodeNames are the RFC 9113 section 7 error code names, as net/http prints them.
var h2CodeNames = []string{"NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR",
	"SETTINGS_TIMEOUT", "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL",
	"COMPRESSION_ERROR", "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED"}

func h2CodeName(code uint32) string {
	if int(code) < len(h2CodeNames) {
		return h2CodeNames[code]
	}
	return fmt.Sprintf("0x%x", code)
}

// transportFailure is a recognised transport or protocol failure.
type transportFailure struct {
	reason string
	// unprocessed: the server said it did not process the request (REFUSED_STREAM, or a
	// GOAWAY whose last-stream-id is below the request's stream), or the request never
	// left the client.
	unprocessed bool
}

// transportMessages are net/http's messages for failures without an exported type, with
// what each means. All are retryable; unprocessed ones are not ambiguous.
var transportMessages = []struct {
	prefix string
	transportFailure
}{
	// The server sent GOAWAY and then closed the connection. net/http reports this only
	// for streams at or below the GOAWAY's last-stream-id (the server took them and may
	// have processed them); streams above it were ended when the GOAWAY arrived, with
	// the two messages below.
	{"http2: server sent GOAWAY and closed the connection", transportFailure{reason: "HTTP/2 GOAWAY, then the connection closed"}},
	// A GOAWAY whose last-stream-id is below the request's stream: not processed (RFC
	// 9113 section 6.8). The first is the first stream of a connection with an error
	// code, the second a graceful GOAWAY that net/http retried on new connections
	// until it gave up.
	{"http2: Transport received GOAWAY from server ErrCode:", transportFailure{reason: "HTTP/2 GOAWAY below the request's stream (not processed)", unprocessed: true}},
	{"http2: Transport received Server's graceful shutdown GOAWAY", transportFailure{reason: "HTTP/2 GOAWAY below the request's stream (not processed)", unprocessed: true}},
	// The connection could not take the request: the stream was never opened.
	{"http2: client conn not usable", transportFailure{reason: "HTTP/2 connection unusable (not sent)", unprocessed: true}},
	{"http2: client conn could not be established", transportFailure{reason: "HTTP/2 connection unusable (not sent)", unprocessed: true}},
	// The health-check ping went unanswered (http.HTTP2Config.SendPingTimeout).
	{"http2: client connection lost", transportFailure{reason: "HTTP/2 connection lost (ping timeout)"}},
	{"http2: client conn is closed", transportFailure{reason: "HTTP/2 connection closed"}},
	{"http2: client connection force closed", transportFailure{reason: "HTTP/2 connection closed"}},
	// A reset or GOAWAY that net/http would have retried, but the request body was
	// already sent and cannot be replayed.
	{"http2: Transport: cannot retry err [", transportFailure{reason: "HTTP/2 reset after the request body was sent"}},
	// HTTP/1: the connection broke after the request was (partly) written.
	{"net/http: HTTP/1.x transport connection broken: ", transportFailure{reason: "HTTP/1 connection broken"}},
	// HTTP/1: the server closed a keep-alive connection as the request went out. Very
	// likely not processed, but net/http itself only replays it for idempotent
	// requests, so it is not claimed here either.
	{"http: server closed idle connection", transportFailure{reason: "server closed the idle connection"}},
}

// recogniseTransport reports whether err is one of net/http's transport or protocol
// failures without an exported type, and what it means. It is the only function in the
// package that looks at error messages.
func recogniseTransport(err error) (transportFailure, bool) {
	var se h2StreamError
	if errors.As(err, &se) {
		return streamFailure(h2CodeName(se.Code), se.Cause != nil && se.Cause.Error() == "received from peer"), true
	}
	var found transportFailure
	ok := anyInChain(err, func(e error) bool {
		msg := e.Error()
		for _, m := range transportMessages {
			if strings.HasPrefix(msg, m.prefix) {
				found = m.transportFailure
				return true
			}
		}
		// x/net's StreamError has no As method: its message, "stream error: stream ID
		// N; CODE" with "; received from peer" for a RST_STREAM from the server.
		if rest, ok := strings.CutPrefix(msg, "stream error: stream ID "); ok {
			parts := strings.Split(rest, "; ")
			if len(parts) >= 2 && isH2CodeName(parts[1]) {
				found = streamFailure(parts[1], len(parts) >= 3 && parts[2] == "received from peer")
				return true
			}
		}
		// An HTTP/2 connection error the client detected (the server broke the
		// protocol): net/http's http2ConnectionError, "connection error: CODE".
		if code, ok := strings.CutPrefix(msg, "connection error: "); ok && isH2CodeName(code) {
			found = transportFailure{reason: "HTTP/2 connection error " + code}
			return true
		}
		return false
	})
	return found, ok
}

// streamFailure is an HTTP/2 stream error with code, a RST_STREAM from the server when
// fromPeer, otherwise detected by the client (which then resets the stream itself).
func streamFailure(code string, fromPeer bool) transportFailure {
	if !fromPeer {
		return transportFailure{reason: "HTTP/2 stream error " + code}
	}
	// REFUSED_STREAM means "closed prior to any processing" (RFC 9113 section 8.7); any
	// other code may come after the server processed the request.
	return transportFailure{reason: "HTTP/2 stream reset by the server (RST_STREAM " + code + ")", unprocessed: code == "REFUSED_STREAM"}
}

func isH2CodeName(s string) bool {
	for _, n := range h2CodeNames {
		if s == n {
			return true
		}
	}
	return false
}

// anyInChain reports whether f is true for err or any error it wraps, following
// Unwrap() error and Unwrap() []error depth first.
func anyInChain(err error, f func(error) bool) bool {
	for err != nil {
		if f(err) {
			return true
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if anyInChain(e, f) {
					return true
				}
			}
			return false
		default:
			return false
		}
	}
	return false
}

// NotProcessed reports whether err says the server did not process the request, so
// the request had no effect there and a retry is no duplicate:
//
//   - an HTTP/2 RST_STREAM with REFUSED_STREAM from the server (RFC 9113 section 8.7);
//   - an HTTP/2 GOAWAY whose last-stream-id is below the request's stream (section
//     6.8), which net/http reports as "http2: Transport received GOAWAY from server
//     ErrCode:..." or, after its own retries, "http2: Transport received Server's
//     graceful shutdown GOAWAY";
//   - an HTTP/2 connection that could not take the request, so no stream was opened.
//
// A GOAWAY that covered the request (net/http's "http2: server sent GOAWAY and closed
// the connection"), a stream reset with any other code and a lost connection are false:
// the server may have processed the request. Errors with an HTTP status, and errors
// marked Permanent, are false. The llm_calls ledger (ledger.IsAmbiguous) counts
// such failures as clear, not ambiguous. It is safe for concurrent use.
func NotProcessed(err error) bool {
	if err == nil || errors.Is(err, ErrPermanent) {
		return false
	}
	var hs HTTPStatuser
	if errors.As(err, &hs) && hs.HTTPStatus() != 0 {
		return false
	}
	f, ok := recogniseTransport(err)
	return ok && f.unprocessed
}
