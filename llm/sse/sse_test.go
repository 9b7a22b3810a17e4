package sse_test

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/llm/sse"
)

// parse feeds the stream s in the given chunks (all of it at once when none) and
// returns the events and the parser.
func parse(chunks ...string) ([]sse.Event, *sse.Parser) {
	var p sse.Parser
	var evs []sse.Event
	for _, c := range chunks {
		evs = append(evs, p.Feed([]byte(c))...)
	}
	return append(evs, p.Close()...), &p
}

func TestLineEndings(t *testing.T) {
	t.Parallel()
	for name, eol := range map[string]string{"lf": "\n", "crlf": "\r\n", "cr": "\r"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := "data: one" + eol + eol + "event: two" + eol + "data: 2a" + eol + "data: 2b" + eol + eol
			evs, p := parse(s)
			n := int64(len(eol))
			want := []sse.Event{
				{Type: "message", Data: "one", Start: 0, End: 9 + 2*n},
				{Type: "two", Data: "2a\n2b", Start: 9 + 2*n, End: int64(len(s))},
			}
			if !reflect.DeepEqual(evs, want) || p.Boundary() != int64(len(s)) || p.Residue() {
				t.Fatalf("events %+v\nwant   %+v\nboundary %d residue %v", evs, want, p.Boundary(), p.Residue())
			}
		})
	}
	// Mixed endings in one stream; an LF right after a CR belongs to it, so "\r\r\n" is
	// one line ending and one blank line.
	evs, _ := parse("data: a\r\ndata: b\rdata: c\n\r\n")
	if len(evs) != 1 || evs[0].Data != "a\nb\nc" {
		t.Fatalf("mixed endings: %+v", evs)
	}
	evs, _ = parse("data: a\r\r\n")
	if len(evs) != 1 || evs[0].End != 10 {
		t.Fatalf("CR then CRLF: %+v", evs)
	}
}

// A CR at the end of a chunk and an LF at the start of the next are one line ending:
// not an extra blank line, and the event's End includes the LF.
func TestCRLFSplitAcrossChunks(t *testing.T) {
	t.Parallel()
	var p sse.Parser
	if evs := p.Feed([]byte("data: x\r")); evs != nil {
		t.Fatalf("first chunk: %+v", evs)
	}
	if evs := p.Feed([]byte("\n\r")); evs != nil || p.Boundary() != 0 {
		t.Fatalf("second chunk: %+v, boundary %d (the blank line's ending is not known yet)", evs, p.Boundary())
	}
	evs := p.Feed([]byte("\ndata: y\r"))
	if len(evs) != 1 || evs[0] != (sse.Event{Type: "message", Data: "x", Start: 0, End: 11}) || p.Boundary() != 11 {
		t.Fatalf("third chunk: %+v, boundary %d", evs, p.Boundary())
	}
	if evs := p.Feed([]byte("\n\r")); evs != nil {
		t.Fatalf("fourth chunk: %+v", evs)
	}
	// The stream ends after a CR: Close releases the event it held back.
	evs = p.Close()
	if len(evs) != 1 || evs[0] != (sse.Event{Type: "message", Data: "y", Start: 11, End: 21}) || p.Boundary() != 21 || p.Residue() {
		t.Fatalf("close: %+v, boundary %d", evs, p.Boundary())
	}
}

func TestParserReadsFieldsAsTheSSEStandardSays(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, stream string
		want         []sse.Event // Start and End not compared
		residue      bool
	}{
		{"comments are ignored", ": hello\ndata: x\n: there\n\n", []sse.Event{{Type: "message", Data: "x"}}, false},
		{"comment-only block", ": keep-alive\n\n", nil, false},
		{"no space after the colon", "data:x\nevent:t\n\n", []sse.Event{{Type: "t", Data: "x"}}, false},
		{"only one space is stripped", "data:  x \n\n", []sse.Event{{Type: "message", Data: " x "}}, false},
		{"a colon in the value", "data: a: b\n\n", []sse.Event{{Type: "message", Data: "a: b"}}, false},
		{"a field without colon", "data\n\n", []sse.Event{{Type: "message", Data: ""}}, false},
		{"empty data lines", "data:\ndata:\n\n", []sse.Event{{Type: "message", Data: "\n"}}, false},
		{"the type does not carry over", "event: a\ndata: 1\n\ndata: 2\n\n", []sse.Event{{Type: "a", Data: "1"}, {Type: "message", Data: "2"}}, false},
		{"no data: no event", "event: a\n\ndata: 2\n\n", []sse.Event{{Type: "message", Data: "2"}}, false},
		{"no data at the end is residue", "data: 1\n\nevent: a\n\n", []sse.Event{{Type: "message", Data: "1"}}, true},
		{"the id carries over", "id: 7\ndata: 1\n\ndata: 2\n\nid\ndata: 3\n\n", []sse.Event{{Type: "message", Data: "1", ID: "7"}, {Type: "message", Data: "2", ID: "7"}, {Type: "message", Data: "3"}}, false},
		{"an id with NUL is ignored", "id: 1\ndata: a\n\nid: 2\x00\ndata: b\n\n", []sse.Event{{Type: "message", Data: "a", ID: "1"}, {Type: "message", Data: "b", ID: "1"}}, false},
		{"unknown fields are ignored", "foo: bar\ndata: x\n\n", []sse.Event{{Type: "message", Data: "x"}}, false},
		{"an unfinished event is discarded", "data: 1\n\ndata: 2\n", []sse.Event{{Type: "message", Data: "1"}}, true},
		{"an unfinished line is discarded", "data: 1\n\ndata: 2", []sse.Event{{Type: "message", Data: "1"}}, true},
		{"an unfinished comment is not residue", "data: 1\n\n: bye", []sse.Event{{Type: "message", Data: "1"}}, false},
		{"blank lines and spaces are not residue", "data: 1\n\n\n\n  \n\t\n", []sse.Event{{Type: "message", Data: "1"}}, false},
		{"a retry hint is not residue", "data: 1\n\nretry: 3000\n\n", []sse.Event{{Type: "message", Data: "1"}}, false},
		{"a leading BOM is ignored", "\xEF\xBB\xBFdata: 1\n\n", []sse.Event{{Type: "message", Data: "1"}}, false},
		{"a later BOM is not", "data: 1\n\n\xEF\xBB\xBFdata: 2\n\n", []sse.Event{{Type: "message", Data: "1"}}, true},
		{"a partial BOM is text", "\xEF\xBBdata: 1\n\n", nil, true},
		{"nothing", "", nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			for _, chunks := range [][]string{{c.stream}, strings.Split(c.stream, "")} {
				evs, p := parse(chunks...)
				for i := range evs {
					evs[i].Start, evs[i].End = 0, 0
				}
				if !reflect.DeepEqual(evs, c.want) || p.Residue() != c.residue {
					t.Fatalf("%d chunks: events %+v residue %v\nwant %+v residue %v", len(chunks), evs, p.Residue(), c.want, c.residue)
				}
			}
		})
	}
}

func TestRetryIsTheLatestValidRetryFieldInMilliseconds(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]time.Duration{
		"retry: 3000\n":                 3 * time.Second,
		"retry: 3s\n":                   -1,
		"retry: -1\n":                   -1,
		"retry:\n":                      -1,
		"retry: 10\nretry: x\n":         10 * time.Millisecond,
		"retry: 99999999999999999999\n": time.Duration(1<<63-1) / time.Millisecond * time.Millisecond,
	} {
		_, p := parse(s)
		got, ok := p.Retry()
		if !ok {
			got = -1
		}
		if got != want {
			t.Errorf("%q: retry %v, want %v", s, got, want)
		}
	}
}

func TestFeedAfterClosePanics(t *testing.T) {
	t.Parallel()
	var p sse.Parser
	p.Close()
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	p.Feed([]byte("data: x\n\n"))
}

func ExampleParser() {
	var p sse.Parser
	stream := []string{"event: message_start\r\ndata: {\"type\":\"message_start\"}\r", "\n\r\n: ping\r\n\r\ndata: [DO", "NE]\r\n\r\n"}
	for _, chunk := range stream {
		for _, ev := range p.Feed([]byte(chunk)) {
			fmt.Printf("%s %q bytes %d-%d\n", ev.Type, ev.Data, ev.Start, ev.End)
		}
		fmt.Println("boundary", p.Boundary())
	}
	p.Close()
	fmt.Println("residue", p.Residue())
	// Output:
	// boundary 0
	// message_start "{\"type\":\"message_start\"}" bytes 0-56
	// boundary 66
	// message "[DONE]" bytes 66-82
	// boundary 82
	// residue false
}

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
