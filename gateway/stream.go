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
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow/ledger"
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
//
// Once the owner's client has every byte of a complete stream (or is gone), stream
// returns what is left to do, reading the upstream to its end and recording the
// answer, as rest: the caller runs it after the handler returned, so that the client
// gets the end of its response without waiting for the recording's commit. It takes
// resp's body over. A nil rest means the stream is done with.
func (g *Gateway) stream(ctx context.Context, w http.ResponseWriter, att *ledger.Attempt, f *flight, resp *http.Response) (rest func()) {
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
	recorded := make(chan flightEnd, 1)
	go func() {
		defer resp.Body.Close()
		defer func() {
			// This goroutine is not net/http's: a panic here must not take the
			// process down with every other call in flight.
			if p := recover(); p != nil {
				g.log.ErrorContext(ctx, "gateway: recording a stream panicked; the call is left to its lease", "panic", p, "stack", string(debug.Stack()))
				f.finish(flightCut, nil, nil)
				recorded <- flightCut
			}
		}()
		recorded <- g.recordStream(ctx, att, f, resp)
	}()
	switch g.passOn(w, rc, f) {
	case flightComplete, flightRunning: // the client has the whole answer, or left
		return func() { <-recorded }
	case flightCut:
		if <-recorded == flightCut {
			panic(http.ErrAbortHandler) // close the connection: the client must see the stream was cut
		}
	}
	<-recorded
	return nil
}

// passOn writes a flight's bytes to the owner's client as they arrive, until the flight
// ends (its end is returned), its stream is complete and passed on (flightComplete), or
// the client is gone (flightRunning). A gateway closing ends a write the client holds
// up.
func (g *Gateway) passOn(w http.ResponseWriter, rc *http.ResponseController, f *flight) flightEnd {
	defer context.AfterFunc(g.base, func() { _ = rc.SetWriteDeadline(time.Now()) })()
	sent := 0
	for {
		f.mu.Lock()
		body, complete, end, changed := f.body[sent:], f.complete, f.end, f.changed
		f.mu.Unlock()
		if len(body) > 0 {
			if _, err := w.Write(body); err != nil || rc.Flush() != nil {
				return flightRunning
			}
			sent += len(body)
			continue // the flight may have ended meanwhile: read it again
		}
		switch {
		case end != flightRunning:
			return end
		case complete:
			return flightComplete
		}
		<-changed
	}
}

// recordStream reads the upstream stream into the flight, has its output persisted in
// batches for followers on other processes (a persister, on a goroutine of its own: the
// stream never waits for those writes), and records it once complete. It returns how
// the flight ended.
func (g *Gateway) recordStream(ctx context.Context, att *ledger.Attempt, f *flight, resp *http.Response) flightEnd {
	m, _ := json.Marshal(meta{Status: resp.StatusCode, Header: keptHeader(resp.Header)})
	ps := g.newPersister(ctx, att, f, m)
	go ps.run()
	// The persister's writes end before ctx does: a query cancelled mid-flight costs
	// the pool its connection.
	defer func() { <-ps.stopped }()
	var parser sse.Parser // events are counted and the stream cut into partials at event boundaries
	var last *sse.Event
	var su streamUsage
	events := 0
	failed := false // an error event went by
	note := func(evs []sse.Event) {
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
	}
	// The upstream is read on a goroutine of its own, so that a pause in the stream (a
	// model thinking) does not hold back the flight's reader.
	reads := make(chan streamRead, 1)
	next := make(chan struct{})
	defer close(next)
	go readStream(resp.Body, reads, next)
	var readErr error
	size := 0
	for {
		rd := <-reads
		if chunk := rd.chunk; len(chunk) > 0 {
			f.write(chunk)
			size += len(chunk)
			note(parser.Feed(chunk))
			ps.offer(parser.Boundary())
			if int64(size) > g.cfg.MaxResponseBytes {
				readErr = fmt.Errorf("upstream stream exceeds %d bytes", g.cfg.MaxResponseBytes)
				break
			}
		}
		if rd.err == io.EOF {
			break
		}
		if rd.err != nil {
			readErr = rd.err
			break
		}
		next <- struct{}{}
	}
	note(parser.Close())
	// Complete: the connection closed cleanly, the last event is the final one, nothing
	// but comments or blank lines follows it, and no event reported a failure.
	complete := readErr == nil && last != nil && streamEnd(*last) && !parser.Residue() && !failed
	settleSent(f.permit, resp, su.usage(), readErr)
	if !complete {
		// What was received is kept for the record of the cut (a complete stream
		// needs no more partial writes: Succeed records all of it).
		ps.offer(parser.Boundary())
		ps.finish(true)
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
	f.markComplete()
	ps.finish(false)
	raw := f.bytes()
	summary, _ := json.Marshal(map[string]any{"object": "stream", "bytes": len(raw), "events": events})
	// The answer was generated and passed on: it is recorded even when the gateway is
	// closing meanwhile (Close waits for it), within the write's own bounds.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), succeedPatience+cmp.Or(g.cfg.Ledger.WriteTimeout, ledger.DefaultWriteTimeout))
	defer cancel()
	rec, err := g.succeed(rctx, att, ledger.Result{Response: summary, Raw: raw, Meta: m})
	if err != nil {
		g.log.WarnContext(ctx, "gateway: could not record a complete stream", "err", err)
		rec = &ledger.Record{Raw: raw, Meta: m}
	}
	f.finish(flightRecorded, rec, nil)
	g.requests.WithLabelValues(resultForwarded).Inc()
	return flightRecorded
}

// persister writes a stream's output to its llm_calls row while it runs, for requests
// that follow it from other processes: first the announcement (Attempt.Announce: the
// status and headers), then the stream up to its last complete event, in batches
// (ledger.PartialBuffer), and what is buffered every StreamFlushInterval, so that a
// pause in the stream does not hold back what came before it. It runs on a goroutine
// of its own: the stream's reader hands it event boundaries (offer) and never waits
// for its writes, except for a stream that did not complete, whose output is kept
// whole for the record of the cut (finish).
type persister struct {
	g    *Gateway
	ctx  context.Context
	att  *ledger.Attempt
	f    *flight
	meta json.RawMessage

	mu       sync.Mutex
	boundary int  // the stream's bytes up to its last complete event
	done     bool // finish was called
	flush    bool // finish asked for everything to be written
	wake     chan struct{}
	stopped  chan struct{}
}

func (g *Gateway) newPersister(ctx context.Context, att *ledger.Attempt, f *flight, meta json.RawMessage) *persister {
	return &persister{g: g, ctx: ctx, att: att, f: f, meta: meta, wake: make(chan struct{}, 1), stopped: make(chan struct{})}
}

// offer tells the persister the stream's bytes up to b end with a complete event.
func (p *persister) offer(b int64) {
	p.mu.Lock()
	p.boundary = max(p.boundary, int(b))
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// finish stops the persister: with flush, once everything offered is written (it waits
// for that); without, at once, dropping what is not written yet (the answer's record
// holds it all).
func (p *persister) finish(flush bool) {
	p.mu.Lock()
	p.done, p.flush = true, flush
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
	if flush {
		<-p.stopped
	}
}

// dropped reports whether finish stopped the persister without a flush.
func (p *persister) dropped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done && !p.flush
}

func (p *persister) run() {
	defer close(p.stopped)
	ctx := p.ctx
	// Each write is bounded by the ledger's write timeout (a PostgreSQL that hangs holds
	// the persister back no longer), and one that fails is tried again at the next tick
	// (the partial buffer keeps its text): an outage delays what followers on other
	// processes see, and does not end it.
	failing := false // a write failed and none worked since: said once per outage
	result := func(what string, err error) {
		if err == nil {
			failing = false
			return
		}
		if !failing && !p.dropped() {
			p.g.log.WarnContext(ctx, "gateway: could not "+what+"; trying again at the next tick (followers on other processes wait meanwhile)", "err", err)
		}
		failing = true
	}
	ticker := time.NewTicker(cmp.Or(p.g.cfg.Ledger.StreamFlushInterval, ledger.DefaultStreamFlushInterval))
	defer ticker.Stop()
	var partial *ledger.PartialBuffer // set once announced
	persisted := 0                    // bytes of the stream handed to partial
	tick := true                      // the first pass announces at once
	for {
		p.mu.Lock()
		b, done, flush := p.boundary, p.done, p.flush
		p.mu.Unlock()
		if done && !flush {
			return // the answer is being recorded: the writes no longer matter
		}
		if partial == nil && (tick || done) {
			ok, err := p.att.Announce(ctx, p.meta)
			result("announce a stream", err)
			if err == nil && !ok {
				return // the row is no longer this attempt's
			}
			if err == nil {
				partial = p.att.PartialBuffer()
			}
		}
		if partial != nil && b > persisted {
			if b > maxPartialBytes {
				// Each append rewrites the whole partial value: past this size,
				// followers on other processes get the rest from the recorded answer.
				return
			}
			seg := p.f.bytes()[persisted:b]
			// The partial column is text: a stream that is not valid UTF-8 (or holds
			// NUL) keeps what was persisted before it, and nothing after, so the
			// partial is always an exact prefix of what was received.
			if !utf8.Valid(seg) || bytes.IndexByte(seg, 0) >= 0 {
				return
			}
			err := partial.Add(ctx, string(seg))
			persisted = b // taken in, written or buffered
			if errors.Is(err, ledger.ErrPartialStopped) {
				return // the row no longer holds this attempt's output as written
			}
			result("persist partial stream output", err)
		}
		if partial != nil && (tick || done) {
			err := partial.Flush(ctx)
			if errors.Is(err, ledger.ErrPartialStopped) {
				return
			}
			result("persist partial stream output", err)
		}
		if done {
			return // finish(true) waits for this one last try
		}
		select {
		case <-p.wake:
			tick = false
		case <-ticker.C:
			tick = true
		}
	}
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
