package gateway

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
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

// maxPartialBytes bounds the part of a stream persisted while it runs (for requests that
// join it from other processes and for the record of a call cut short).
const maxPartialBytes = 1 << 20

// stream passes a server-sent-event answer on as it arrives, persists it on the row in
// batches, and records it once complete. The upstream is read to its end even when the
// client has gone, so the client's retry gets the whole stream replayed. The bytes go
// into the flight, and the owner's client follows the flight from a goroutine of its
// own, as joiners do: a client that reads slowly (or stops reading) holds back neither
// the upstream call nor anyone else following it.
func (g *Gateway) stream(ctx context.Context, w http.ResponseWriter, att *ledger.Attempt, f *flight, resp *http.Response) {
	kept := keptHeader(resp.Header)
	for k, vs := range kept {
		w.Header()[k] = vs
	}
	if prev, n := att.PreviousPartial(); prev != "" && n > 0 {
		// An earlier attempt died mid-stream: this is a new generation, not its
		// continuation, and the client is told so.
		w.Header().Set(HeaderRestarted, strconv.Itoa(len(prev)))
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	f.start(resp.StatusCode, kept)
	owner := make(chan flightEnd, 1)
	go func() { owner <- g.passOn(w, rc, f) }()
	end := g.recordStream(ctx, att, f, resp)
	if <-owner == flightCut && end == flightCut {
		panic(http.ErrAbortHandler) // close the connection: the client must see the stream was cut
	}
}

// passOn writes a flight's bytes to the owner's client as they arrive, until the flight
// ends (its end is returned) or the client is gone (flightRunning). A gateway closing
// ends a write the client holds up.
func (g *Gateway) passOn(w http.ResponseWriter, rc *http.ResponseController, f *flight) flightEnd {
	defer context.AfterFunc(g.base, func() { _ = rc.SetWriteDeadline(time.Now()) })()
	sent := 0
	for {
		f.mu.Lock()
		body, end, changed := f.body[sent:], f.end, f.changed
		f.mu.Unlock()
		if len(body) > 0 {
			if _, err := w.Write(body); err != nil || rc.Flush() != nil {
				return flightRunning
			}
			sent += len(body)
			continue // the flight may have ended meanwhile: read it again
		}
		if end != flightRunning {
			return end
		}
		<-changed
	}
}

// recordStream reads the upstream stream into the flight, persists it in batches for
// followers on other processes, and records it once complete. It returns how the
// flight ended.
func (g *Gateway) recordStream(ctx context.Context, att *ledger.Attempt, f *flight, resp *http.Response) flightEnd {
	m, _ := json.Marshal(meta{Status: resp.StatusCode, Header: keptHeader(resp.Header)})
	// Followers on other processes need the status and headers before the first byte
	// of the row's partial output, not the clients here before theirs: the stream is
	// read while the announcement commits, and the first partial write waits for it.
	announced := make(chan bool, 1)
	go func() {
		ok, err := att.Announce(ctx, m)
		if err != nil {
			g.log.WarnContext(ctx, "gateway: could not announce a stream; requests joining it on other processes will wait for its end", "err", err)
		}
		announced <- ok
	}()
	partialOK := true // every partial write so far succeeded: the row's partial is an exact prefix of the stream
	awaitAnnounced := func() {
		if announced != nil {
			partialOK = <-announced && partialOK
			announced = nil
		}
	}
	defer awaitAnnounced()
	partial := att.PartialBuffer()
	var parser sse.Parser // events are counted and the stream cut into partials at event boundaries
	var last *sse.Event
	var su streamUsage
	events := 0
	persisted := 0  // bytes of the stream handed to partial
	failed := false // an error event went by
	stopPersisting := func(err error) {
		partialOK = false
		g.log.WarnContext(ctx, "gateway: could not persist partial stream output; persisting no more of this stream (followers on other processes get the rest at its end)", "err", err)
	}
	persist := func(evs []sse.Event) {
		if n := len(evs); n > 0 {
			events += n
			last = &evs[n-1]
		}
		for _, ev := range evs {
			failed = failed || errorEvent(ev)
			if f.permit != nil {
				su.add(ev)
			}
		}
		b := parser.Boundary()
		if !partialOK || int(b) <= persisted {
			return
		}
		if b > maxPartialBytes {
			// Each append rewrites the whole partial value: past this size, followers
			// on other processes get the rest from the recorded answer at the end.
			partialOK = false
			return
		}
		if awaitAnnounced(); !partialOK {
			return
		}
		seg := f.bytes()[persisted:b]
		// The partial column is text: a stream that is not valid UTF-8 (or holds NUL)
		// keeps what was persisted before it, and nothing after, so the partial is
		// always an exact prefix of what was received.
		if !utf8.Valid(seg) || bytes.IndexByte(seg, 0) >= 0 {
			partialOK = false
			return
		}
		if err := partial.Add(ctx, string(seg)); err != nil {
			stopPersisting(err)
			return
		}
		persisted = int(b)
	}
	// The upstream is read on a goroutine of its own, so that a pause in the stream (a
	// model thinking) does not hold back the partial output received before it: what
	// is buffered is persisted every StreamFlushInterval, for followers on other
	// processes.
	reads := make(chan streamRead, 1)
	next := make(chan struct{})
	defer close(next)
	go readStream(resp.Body, reads, next)
	ticker := time.NewTicker(cmp.Or(g.cfg.Ledger.StreamFlushInterval, ledger.DefaultStreamFlushInterval))
	defer ticker.Stop()
	var readErr error
	size := 0
read:
	for {
		var rd streamRead
		select {
		case <-ticker.C:
			if partialOK {
				if err := partial.Flush(ctx); err != nil {
					stopPersisting(err)
				}
			}
			continue
		case rd = <-reads:
		}
		if chunk := rd.chunk; len(chunk) > 0 {
			f.write(chunk)
			size += len(chunk)
			persist(parser.Feed(chunk))
			if int64(size) > g.cfg.MaxResponseBytes {
				readErr = fmt.Errorf("upstream stream exceeds %d bytes", g.cfg.MaxResponseBytes)
				break read
			}
		}
		switch {
		case rd.err == io.EOF:
			break read
		case rd.err != nil:
			readErr = rd.err
			break read
		}
		next <- struct{}{}
	}
	persist(parser.Close())
	// Complete: the connection closed cleanly, the last event is the final one, nothing
	// but comments or blank lines follows it, and no event reported a failure.
	complete := readErr == nil && last != nil && streamEnd(*last) && !parser.Residue() && !failed
	settleSent(f.permit, resp, su.usage(), readErr)
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
			// The upstream said the generation failed, and the stream carried its
			// whole answer, error included: a clear failure, passed on as it ended to
			// everyone following it; a retry is a new attempt.
			g.fail(ctx, att, cause, false)
			f.finish(flightEnded, nil, nil)
			return flightEnded
		}
		// A stream cut short was generated (and billed) in part: ambiguous. One that
		// outgrew the recording limit is a clear failure.
		g.fail(ctx, att, cause, readErr == nil || ledger.IsAmbiguous(readErr) && int64(size) <= g.cfg.MaxResponseBytes)
		f.finish(flightCut, nil, nil)
		return flightCut
	}
	raw := f.bytes()
	summary, _ := json.Marshal(map[string]any{"object": "stream", "bytes": len(raw), "events": events})
	rec, err := g.succeed(ctx, att, ledger.Result{Response: summary, Raw: raw, Meta: m})
	if err != nil {
		g.log.WarnContext(ctx, "gateway: could not record a complete stream", "err", err)
		rec = &ledger.Record{Raw: raw, Meta: m}
	}
	f.finish(flightRecorded, rec, nil)
	g.requests.WithLabelValues(resultForwarded).Inc()
	return flightRecorded
}

// streamRead is one Read of an upstream stream.
type streamRead struct {
	chunk []byte
	err   error
}

// readStream reads body into reads, one Read at a time: after each, it waits on next
// before reusing its buffer, and returns after an error or when next is closed. reads
// must have room for one value, so that a Read that the closing of body ends can be
// sent after the reader stopped listening.
func readStream(body io.Reader, reads chan<- streamRead, next <-chan struct{}) {
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		reads <- streamRead{chunk: buf[:n], err: err}
		if err != nil {
			return
		}
		if _, ok := <-next; !ok {
			return
		}
	}
}
