package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/onceflow/onceflow/llm/ledger"
	"github.com/onceflow/onceflow/llm/sse"
)

// streamEnd reports whether ev is the final event of a complete stream: OpenAI Chat
// Completions' terminator (data: [DONE]), the end of an OpenAI Responses stream
// (response.completed, response.incomplete) or Anthropic's message_stop, named by the
// event field or by the data's "type". Only the last event of a stream counts: the
// same words inside an earlier event's text, or followed by more events, do not.
func streamEnd(ev sse.Event) bool {
	if strings.TrimSpace(ev.Data) == "[DONE]" {
		return true
	}
	var d struct {
		Type string `json:"type"`
	}
	typ := ev.Type
	if typ == "message" && json.Unmarshal([]byte(ev.Data), &d) == nil {
		typ = d.Type
	}
	switch typ {
	case "message_stop", "response.completed", "response.incomplete":
		return true
	}
	return false
}

// errorEvent reports whether ev reports a failure inside the stream: Anthropic's
// "event: error", or data whose top-level object has an "error" member or the type
// "error" (OpenAI-compatible servers, vLLM among them, send such an event and may still
// end the stream with [DONE]). A stream that carried one is not a complete answer.
func errorEvent(ev sse.Event) bool {
	if ev.Type == "error" {
		return true
	}
	var d map[string]json.RawMessage
	if json.Unmarshal([]byte(ev.Data), &d) != nil {
		return false
	}
	if _, ok := d["error"]; ok {
		return true
	}
	var typ string
	return json.Unmarshal(d["type"], &typ) == nil && typ == "error"
}

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
	partialOK := true // every partial write so far succeeded: the row's partial is an exact prefix of raw
	var raw bytes.Buffer
	var parser sse.Parser // events are counted and the stream cut into partials at event boundaries
	var last *sse.Event
	events := 0
	persisted := int64(0) // bytes of raw handed to partial
	failed := false       // an error event went by
	persist := func(evs []sse.Event) {
		if n := len(evs); n > 0 {
			events += n
			last = &evs[n-1]
		}
		for _, ev := range evs {
			failed = failed || errorEvent(ev)
		}
		b := parser.Boundary()
		if !partialOK || b <= persisted {
			return
		}
		seg := raw.Bytes()[persisted:b]
		// The partial column is text: a stream that is not valid UTF-8 (or holds NUL)
		// keeps what was persisted before it, and nothing after, so the partial is
		// always an exact prefix of what was received.
		if !utf8.Valid(seg) || bytes.IndexByte(seg, 0) >= 0 {
			partialOK = false
			return
		}
		if err := partial.Add(ctx, string(seg)); err != nil {
			partialOK = false
			g.log.WarnContext(ctx, "gateway: could not persist partial stream output; persisting no more of this stream", "err", err)
			return
		}
		persisted = b
	}
	buf := make([]byte, 32<<10)
	var readErr error
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			raw.Write(chunk)
			persist(parser.Feed(chunk))
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
	persist(parser.Close())
	// Complete: the connection closed cleanly, the last event is the final one, nothing
	// but comments or blank lines follows it, and no event reported a failure.
	complete := readErr == nil && last != nil && streamEnd(*last) && !parser.Residue() && !failed
	if !complete {
		if partialOK {
			if err := partial.Flush(ctx); err != nil {
				g.log.WarnContext(ctx, "gateway: could not persist partial stream output", "err", err)
			}
		}
		cause := readErr
		switch {
		case cause == nil && failed:
			cause = errors.New("upstream stream reported an error event")
		case cause == nil:
			cause = errors.New("upstream stream ended without its final event")
		}
		g.requests.WithLabelValues(resultUpstreamError).Inc()
		if failed && readErr == nil {
			// The upstream said the generation failed, and the client got its whole
			// answer, error included: a clear failure; a retry is a new attempt.
			g.fail(ctx, att, cause, false)
			return
		}
		// A stream cut short was generated (and billed) in part: ambiguous. One that
		// outgrew the recording limit is a clear failure.
		g.fail(ctx, att, cause, readErr == nil || ledger.IsAmbiguous(readErr) && int64(raw.Len()) <= g.cfg.MaxResponseBytes)
		if !clientGone {
			panic(http.ErrAbortHandler) // close the connection: the client must see the stream was cut
		}
		return
	}
	m, _ := json.Marshal(meta{Status: resp.StatusCode, Header: keptHeader(resp.Header)})
	summary, _ := json.Marshal(map[string]any{"object": "stream", "bytes": raw.Len(), "events": events})
	if _, _, err := att.Succeed(ctx, ledger.Result{Response: summary, Raw: raw.Bytes(), Meta: m}); err != nil {
		g.log.WarnContext(ctx, "gateway: could not record a complete stream", "err", err)
	}
	g.requests.WithLabelValues(resultForwarded).Inc()
}
