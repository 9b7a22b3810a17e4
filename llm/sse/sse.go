// Package sse parses server-sent event streams (text/event-stream) incrementally, as
// the WHATWG HTML standard's "event stream interpretation" describes: lines end with
// CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of the next are
// one line ending); "field: value" with one optional space after the colon; a line
// starting with a colon is a comment; data lines join with "\n"; a blank line
// dispatches the event, unless it has no data; a leading byte order mark is ignored;
// an unfinished event at the end of the stream is discarded.
//
// Besides the events, a Parser reports byte offsets: where each event's raw bytes
// start and end, and the last boundary (the end of the last blank line), so a caller
// that keeps the raw bytes (a proxy persisting a partial stream, a recorder replaying
// one byte for byte) can cut them between events whatever the line endings.
//
// The parser works on bytes and does not validate UTF-8: Data and the other fields are
// the bytes the stream carried.
package sse

import (
	"bytes"
	"strconv"
	"time"
)

// Event is one dispatched event.
type Event struct {
	// Type is the event's "event" field, or "message" when it had none (as the
	// standard's EventSource reports it).
	Type string
	// Data is the event's data lines joined with "\n".
	Data string
	// ID is the last event ID when the event was dispatched: the value of the latest
	// "id" field of the stream so far (not necessarily of this event), "" if none.
	ID string
	// Start and End are the offsets, in the bytes fed to the Parser, of the event's
	// raw bytes: from just after the previous blank line (or the start of the stream)
	// to just after the blank line that dispatched it, line ending included. Comments
	// and fields the event ignored between the two belong to it.
	Start, End int64
}

// Parser is an incremental event stream parser: Feed it the stream's bytes in chunks
// of any size, then Close it at the end of the stream. The events, offsets and
// boundaries it reports do not depend on how the stream was split into chunks. The
// zero Parser is ready to use; a Parser is not safe for concurrent use.
//
// It buffers the current line and the current event's data, so its memory grows with
// the longest event: bound the stream's size before feeding untrusted input.
type Parser struct {
	off        int64  // bytes fed so far
	bom        int    // bytes of a leading byte order mark matched so far; -1 once decided
	line       []byte // the current line, without its ending
	pendingCR  bool   // the last byte fed was a CR ending a line: an LF next belongs to it
	deferred   bool   // that CR ended a blank line, whose boundary waits for the next byte
	blockStart int64  // offset just after the last blank line
	boundary   int64  // the same, published once its line ending is known
	data       []byte // the data buffer, each line followed by "\n"
	hasData    bool
	eventType  string
	lastID     string
	retry      time.Duration
	hasRetry   bool
	residue    bool // a field line (or unfinished line) since the last dispatched event
	next       *Event
	out        []Event
	closed     bool
}

var bom = []byte{0xEF, 0xBB, 0xBF}

// Feed parses the next chunk of the stream and returns the events it completed, in
// order (nil if none). An event whose blank line ends in a CR at the very end of the
// chunk is returned by the next Feed or by Close, when it is known whether an LF
// follows. Feed panics after Close.
func (p *Parser) Feed(b []byte) []Event {
	if p.closed {
		panic("sse: Feed after Close")
	}
	p.out = nil
	for len(b) > 0 {
		if p.pendingCR {
			p.pendingCR = false
			if b[0] == '\n' {
				p.off++
				b = b[1:]
				if p.deferred {
					p.endBlock()
				}
				continue
			}
			if p.deferred {
				p.endBlock()
			}
		}
		if p.bom >= 0 {
			b = p.skipBOM(b)
			continue
		}
		i := bytes.IndexAny(b, "\r\n")
		if i < 0 {
			p.line = append(p.line, b...)
			p.off += int64(len(b))
			break
		}
		p.line = append(p.line, b[:i]...)
		p.off += int64(i) + 1
		cr := b[i] == '\r'
		b = b[i+1:]
		p.endLine(cr)
	}
	out := p.out
	p.out = nil
	return out
}

// skipBOM consumes the bytes of a leading byte order mark from b, or decides there is
// none (the bytes matched so far are then the start of the first line), and returns
// the rest of b.
func (p *Parser) skipBOM(b []byte) []byte {
	for len(b) > 0 && p.bom >= 0 {
		if b[0] != bom[p.bom] {
			p.line = append(p.line, bom[:p.bom]...) // already counted in off
			p.bom = -1
			return b
		}
		p.bom++
		p.off++
		b = b[1:]
		if p.bom == len(bom) {
			p.bom = -1
		}
	}
	return b
}

// endLine processes the line just ended; cr reports that a CR ended it.
func (p *Parser) endLine(cr bool) {
	p.pendingCR = cr
	line := p.line
	p.line = p.line[:0]
	if len(line) > 0 {
		p.field(line)
		return
	}
	// A blank line: dispatch the event, if it has data, and reset its buffers.
	if p.hasData {
		data := p.data
		if n := len(data); n > 0 && data[n-1] == '\n' {
			data = data[:n-1]
		}
		typ := p.eventType
		if typ == "" {
			typ = "message"
		}
		p.next = &Event{Type: typ, Data: string(data), ID: p.lastID, Start: p.blockStart}
		p.residue = false
	}
	p.data, p.hasData, p.eventType = p.data[:0], false, ""
	if cr {
		p.deferred = true // an LF may follow in the next chunk
		return
	}
	p.endBlock()
}

// endBlock publishes the boundary after a blank line, and the event it dispatched.
func (p *Parser) endBlock() {
	p.deferred = false
	if p.next != nil {
		p.next.End = p.off
		p.out = append(p.out, *p.next)
		p.next = nil
	}
	p.blockStart, p.boundary = p.off, p.off
}

// field processes a non-blank line.
func (p *Parser) field(line []byte) {
	if line[0] == ':' {
		return // a comment
	}
	name, value := line, []byte(nil)
	if i := bytes.IndexByte(line, ':'); i >= 0 {
		name, value = line[:i], line[i+1:]
		if len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
	}
	switch string(name) {
	case "event":
		p.eventType = string(value)
	case "data":
		p.data = append(append(p.data, value...), '\n')
		p.hasData = true
	case "id":
		if bytes.IndexByte(value, 0) < 0 {
			p.lastID = string(value)
		}
	case "retry":
		if onlyDigits(value) {
			ms, err := strconv.ParseUint(string(value), 10, 64)
			if err != nil || ms > maxRetryMillis {
				ms = maxRetryMillis // more digits than a Duration holds
			}
			p.retry, p.hasRetry = time.Duration(ms)*time.Millisecond, true // #nosec G115 -- ms <= maxRetryMillis
		}
		return // a reconnection hint, never part of an event
	}
	if !blank(line) {
		p.residue = true
	}
}

// maxRetryMillis is the longest retry hint a time.Duration holds, in milliseconds.
const maxRetryMillis = uint64(1<<63-1) / uint64(time.Millisecond)

// onlyDigits reports whether b is one or more ASCII digits, the only retry value the
// standard accepts.
func onlyDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return len(b) > 0
}

// blank reports whether a line is spaces and tabs only.
func blank(line []byte) bool {
	return len(bytes.Trim(line, " \t")) == 0
}

// Close ends the stream and returns the event a final blank line ending in CR was
// holding back, if any. An unfinished event (no blank line after it) and an
// unfinished line are discarded. Close may be called more than once.
func (p *Parser) Close() []Event {
	if p.closed {
		return nil
	}
	p.closed = true
	p.out = nil
	if p.bom > 0 {
		p.line = append(p.line, bom[:p.bom]...)
	}
	p.bom = -1
	if p.deferred {
		p.endBlock()
	}
	p.pendingCR = false
	if len(p.line) > 0 && p.line[0] != ':' && !blank(p.line) {
		p.residue = true
	}
	p.line = p.line[:0]
	out := p.out
	p.out = nil
	return out
}

// Offset returns the number of bytes fed so far.
func (p *Parser) Offset() int64 { return p.off }

// Boundary returns the offset just after the last blank line whose line ending is
// known (0 before the first): the bytes before it are whole events, comments and
// ignored fields, and the parser holds no part of them but the last event ID and the
// retry hint. Cutting a stream's raw bytes at Boundary never cuts an event in two.
func (p *Parser) Boundary() int64 { return p.boundary }

// Residue reports whether the stream carried anything since the last dispatched event
// (since its start, if none was) besides comments, blank lines, retry hints and lines
// of spaces and tabs: fields of an event that was never dispatched, or, once Closed,
// an unfinished line. A stream whose final event must be the last thing in it is cut
// short when Residue is true.
func (p *Parser) Residue() bool { return p.residue }

// LastEventID returns the value of the stream's latest "id" field, "" if none.
func (p *Parser) LastEventID() string { return p.lastID }

// Retry returns the stream's latest valid "retry" hint (the reconnection time the
// server asks for), and whether it sent one.
func (p *Parser) Retry() (time.Duration, bool) { return p.retry, p.hasRetry }
