package sse_test

import (
	"reflect"
	"testing"

	"github.com/onceflow/onceflow/llm/sse"
)

// FuzzParser: the parser never panics; the events, offsets, boundary and residue do
// not depend on how the stream is split into chunks; offsets lie within the input and
// end on a line ending; every event returned so far ends at or before Boundary, which
// never goes back; and the bytes before the final boundary, parsed alone, give the same
// events (what a proxy persisting a partial stream at Boundary relies on).
func FuzzParser(f *testing.F) {
	for _, s := range []string{
		"data: a\n\n", "data: a\r\n\r\n", "data: a\r\rdata: b\r\r", "event: x\ndata: 1\ndata: 2\n\n: c\n\n",
		"\xEF\xBB\xBFdata: 1\n\n", "id: 1\nretry: 10\ndata\n\n", "data: [DONE]\n\ndata: {\"t\":\"x\"", "\r\n\r\n\n\r",
		"data: {\"content\":\"data: [DONE]\\n\\n\"}\n\n", ":\r\n\r", "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
	} {
		f.Add([]byte(s), []byte{1, 3, 0, 7})
	}
	f.Fuzz(func(t *testing.T, stream, splits []byte) {
		whole, wp := parse(string(stream))
		var p sse.Parser
		var evs []sse.Event
		rest, boundary := stream, int64(0)
		for i := 0; len(rest) > 0; i++ {
			n := len(rest)
			if len(splits) > 0 {
				n = min(n, 1+int(splits[i%len(splits)])%8)
			}
			evs = append(evs, p.Feed(rest[:n])...)
			rest = rest[n:]
			if b := p.Boundary(); b < boundary || b > p.Offset() {
				t.Fatalf("boundary %d after %d, offset %d", b, boundary, p.Offset())
			}
			boundary = p.Boundary()
			if len(evs) > 0 && evs[len(evs)-1].End > boundary {
				t.Fatalf("event %+v returned beyond the boundary %d", evs[len(evs)-1], boundary)
			}
		}
		evs = append(evs, p.Close()...)
		if !reflect.DeepEqual(evs, whole) || p.Boundary() != wp.Boundary() || p.Residue() != wp.Residue() ||
			p.Offset() != int64(len(stream)) || p.LastEventID() != wp.LastEventID() {
			t.Fatalf("chunked %+v (boundary %d residue %v)\nwhole   %+v (boundary %d residue %v)", evs, p.Boundary(), p.Residue(), whole, wp.Boundary(), wp.Residue())
		}
		end := int64(0)
		for _, ev := range evs {
			if ev.Start < end || ev.End <= ev.Start || ev.End > int64(len(stream)) || ev.End > p.Boundary() {
				t.Fatalf("event %+v out of order or outside [%d, %d]", ev, end, len(stream))
			}
			if c := stream[ev.End-1]; c != '\n' && c != '\r' {
				t.Fatalf("event %+v does not end on a line ending", ev)
			}
			end = ev.End
		}
		prefix, _ := parse(string(stream[:p.Boundary()]))
		if !reflect.DeepEqual(prefix, evs) {
			t.Fatalf("the bytes before the boundary parse to %+v, not %+v", prefix, evs)
		}
	})
}
