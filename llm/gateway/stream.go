package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/onceflow/onceflow/llm/ledger"
)

// streamEnds are the events that end a complete stream: OpenAI's terminator and
// Anthropic's last event. A stream whose connection closes cleanly without one was cut
// short (an HTTP/1.0 upstream, a proxy) and is not recorded.
var streamEnds = [][]byte{[]byte("data: [DONE]"), []byte("event: message_stop")}

// stream passes a server-sent-event answer on as it arrives, persists it on the row in
// batches, and records it once complete. The upstream is read to its end even when the
// client has gone, so the client's retry gets the whole stream replayed.
func (g *Gateway) stream(ctx context.Context, w http.ResponseWriter, att *ledger.Attempt, resp *http.Response) {
	for k, vs := range resp.Header {
		if recordedHeader(k) {
			w.Header()[k] = vs
		}
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	clientGone := false
	partial := att.PartialBuffer()
	var raw bytes.Buffer
	persisted := 0 // bytes of raw handed to partial: whole events only, so always valid UTF-8 text
	buf := make([]byte, 32<<10)
	var readErr error
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			raw.Write(chunk)
			if end := bytes.LastIndex(raw.Bytes(), []byte("\n\n")); end >= 0 && end+2 > persisted {
				if err := partial.Add(ctx, string(raw.Bytes()[persisted:end+2])); err != nil {
					g.log.WarnContext(ctx, "gateway: could not persist partial stream output", "err", err)
				}
				persisted = end + 2
			}
			if !clientGone {
				if _, werr := w.Write(chunk); werr != nil || rc.Flush() != nil {
					clientGone = true // keep reading: the answer is still recorded
				}
			}
			if int64(raw.Len()) > g.cfg.MaxResponseBytes {
				readErr = fmt.Errorf("upstream stream exceeds %d bytes", g.cfg.MaxResponseBytes)
				break
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			readErr = err
			break
		}
	}
	complete := false
	for _, end := range streamEnds {
		complete = complete || (readErr == nil && bytes.Contains(raw.Bytes(), end))
	}
	if !complete {
		if err := partial.Flush(ctx); err != nil {
			g.log.WarnContext(ctx, "gateway: could not persist partial stream output", "err", err)
		}
		cause := readErr
		if cause == nil {
			cause = errors.New("upstream stream ended without its final event")
		}
		// A stream cut short was generated (and billed) in part: ambiguous. One that
		// outgrew the recording limit is a clear failure.
		g.fail(ctx, att, cause, readErr == nil || ledger.IsAmbiguous(readErr) && int64(raw.Len()) <= g.cfg.MaxResponseBytes)
		g.requests.WithLabelValues(resultUpstreamError).Inc()
		if !clientGone {
			panic(http.ErrAbortHandler) // close the connection: the client must see the stream was cut
		}
		return
	}
	m, _ := json.Marshal(meta{Status: resp.StatusCode, Header: keptHeader(resp.Header)})
	summary, _ := json.Marshal(map[string]any{"object": "stream", "bytes": raw.Len(), "events": bytes.Count(raw.Bytes(), []byte("\n\n"))})
	if _, _, err := att.Succeed(ctx, ledger.Result{Response: summary, Raw: raw.Bytes(), Meta: m}); err != nil {
		g.log.WarnContext(ctx, "gateway: could not record a complete stream", "err", err)
	}
	g.requests.WithLabelValues(resultForwarded).Inc()
}
