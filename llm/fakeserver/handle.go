package fakeserver

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// FaultKind names an injected fault.
type FaultKind string

// The faults Script accepts; the names are also the keys of Stats.ByFault.
const (
	FaultNone  FaultKind = ""
	Fault429   FaultKind = "fail_429"
	Fault503   FaultKind = "fail_503"
	FaultQuota FaultKind = "fail_quota"
	FaultHang  FaultKind = "hang"
	FaultDrip  FaultKind = "drip"
	FaultDrop  FaultKind = "drop_stream"
	// FaultMalformed answers 200 with a JSON body cut short: a provider bug that no
	// retry fixes.
	FaultMalformed FaultKind = "malformed"
	// FaultStreamError ends a stream halfway with the provider's error event
	// (server_error for OpenAI, overloaded_error for Anthropic), as providers do when
	// they fail mid-generation; a plain answer is sent normally.
	FaultStreamError FaultKind = "stream_error"
)

// Fault is one scripted fault. Header, when set, is added to the answer (for example
// a Retry-After as an HTTP-date, retry-after-ms, or x-should-retry) and replaces the
// default Retry-After of a 429.
type Fault struct {
	Kind   FaultKind
	Header http.Header
}

// chatRequest is a parsed model request, whichever the dialect.
type chatRequest struct {
	Model        string
	Messages     []llm.Message
	Temperature  *float64
	MaxTokens    int
	Tools        []llm.Tool
	Stream       bool
	IncludeUsage bool
	// ToolResults counts the tool results of the conversation (OpenAI's tool messages,
	// the Responses API's function_call_output items, Anthropic's tool_result
	// blocks): the index of the script turn that answers it.
	ToolResults int
	// Choice is the request's tool_choice. Calls are the tool calls the answer makes,
	// without ids (none: text), decided by pickTool or the script; Text, when set, is
	// a scripted text answer (nil: the summary).
	Choice toolChoice
	Calls  []llm.ToolCall
	Text   *string
	// Echo is what the dialect's answer repeats of its request (the Responses API
	// echoes instructions, tools, tool_choice, ...); nil for the other dialects.
	Echo any
}

// toolChoice is a request's tool_choice, in either dialect.
type toolChoice struct {
	mode choiceMode
	name string // the tool of choiceNamed
}

// choiceMode is what a request's tool_choice allows.
type choiceMode int

const (
	choiceAuto     choiceMode = iota // absent, OpenAI "auto", Anthropic {"type":"auto"}: the model decides
	choiceNone                       // OpenAI "none", Anthropic {"type":"none"}: no tool call
	choiceRequired                   // OpenAI "required", Anthropic {"type":"any"}: some tool call
	choiceNamed                      // a named function or tool: a call to it
)

// declares returns the tool of req named name, or nil.
func (r *chatRequest) declares(name string) *llm.Tool {
	for i := range r.Tools {
		if r.Tools[i].Name == name {
			return &r.Tools[i]
		}
	}
	return nil
}

// pickTool decides the tool call of the answer to req (req.Calls): none without tools
// or with tool_choice none; else Config.ToolChoice's pick (the first tool without
// one), overridden by a named or required tool_choice. Arguments a ToolChooser gives
// that are not a JSON object are a 400 naming the tool.
func (s *Server) pickTool(req *chatRequest, d dialect) *apiError {
	if len(req.Tools) == 0 || req.Choice.mode == choiceNone {
		return nil
	}
	name, args, ok := req.Tools[0].Name, json.RawMessage(nil), true
	if s.cfg.ToolChoice != nil {
		name, args, ok = s.cfg.ToolChoice(&llm.Request{Model: req.Model, Messages: req.Messages, Temperature: req.Temperature,
			MaxTokens: req.MaxTokens, Tools: req.Tools})
	}
	if !ok || req.declares(name) == nil {
		name, args = "", nil
	}
	switch req.Choice.mode {
	case choiceNamed:
		if name != req.Choice.name {
			name, args = req.Choice.name, nil
		}
	case choiceRequired:
		if name == "" {
			name = req.Tools[0].Name
		}
	}
	if name == "" {
		return nil
	}
	tool := req.declares(name)
	call := llm.ToolCall{Name: name, Arguments: fake.ToolArguments(tool.Parameters, fake.Prompt(req.Messages))}
	if len(args) > 0 {
		var buf bytes.Buffer
		if err := json.Compact(&buf, args); err != nil || buf.Len() == 0 || buf.Bytes()[0] != '{' {
			e := d.errorOf(errInvalid, fmt.Sprintf("fake-llm: the arguments configured for tool %q are not a JSON object", name), req)
			return &e
		}
		call.Arguments = buf.String()
	}
	req.Calls = []llm.ToolCall{call}
	return nil
}

// decide decides what the answer to req says: with a script, its turn for req, as
// written (neither Config.ToolChoice nor the request's tools and tool_choice change
// it); otherwise pickTool's call, or the summary.
func (s *Server) decide(ctx context.Context, req *chatRequest, d dialect) *apiError {
	if len(s.turns) == 0 {
		return s.pickTool(req, d)
	}
	i := s.scriptTurn(req)
	t := s.turns[i]
	if len(t.calls) > 0 {
		req.Calls = t.calls
	} else {
		req.Text = &t.text
	}
	s.log.DebugContext(ctx, "fake-llm scripted turn", "endpoint", d.endpoint(), "turn", i, "tool_results", req.ToolResults, "tool_calls", len(t.calls))
	return nil
}

// request is r as an llm.Request, for the token estimate of the rate limits.
func (r *chatRequest) request() *llm.Request {
	return &llm.Request{Model: r.Model, Messages: r.Messages, Temperature: r.Temperature, MaxTokens: r.MaxTokens, Tools: r.Tools}
}

func (r *chatRequest) inputChars() int {
	n := 0
	for _, m := range r.Messages {
		n += utf8.RuneCountInString(m.Content)
	}
	return n
}

// completion is a generated answer, before a dialect renders it.
type completion struct {
	ID       string
	Created  int64
	Model    string
	Content  string
	Tools    []llm.ToolCall
	InTokens int
	OutToken int
}

// apiError is an error answer, rendered by a dialect.
type apiError struct {
	status                    int
	typ, code, param, message string
	header                    http.Header
}

// The error answers a dialect knows how to shape.
type errKind int

const (
	errRateLimit errKind = iota
	errQuota
	errOverloaded
	errContextLength
	errInvalid
	errConflict
	errTooLarge
)

// dialect is one provider's wire format.
type dialect interface {
	endpoint() string
	requestIDHeader() string
	idPrefix() string
	toolIDPrefix() string
	parse(body []byte) (*chatRequest, *apiError)
	errorOf(k errKind, detail string, req *chatRequest) apiError
	writeError(w http.ResponseWriter, e apiError)
	// errorEvent is the event that ends a stream failing mid-generation, after sent
	// events.
	errorEvent(sent int) []byte
	render(req *chatRequest, c completion) *recorded
	// rateLimited is the 429 of a request over a rate limit (Config.RPM, Config.TPM).
	rateLimited(r rejection, req *chatRequest) apiError
	// rateHeaders sets the provider's rate-limit headers of st on h.
	rateHeaders(h http.Header, st rateState)
}

// model answers one request to a model endpoint.
func (s *Server) model(w http.ResponseWriter, r *http.Request, d dialect) {
	key := r.Header.Get("Idempotency-Key")
	s.mu.Lock()
	s.stats.Requests++
	s.stats.ByEndpoint[d.endpoint()]++
	if key != "" {
		s.stats.ByIdempotencyKey[key]++
	}
	s.stats.InFlight++
	requestID := "req_" + s.randHex(32)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.stats.InFlight--
		s.mu.Unlock()
	}()

	sw := &statusWriter{ResponseWriter: w, s: s}
	w = sw
	w.Header().Set(d.requestIDHeader(), requestID)
	ctx := r.Context()
	// A limited server sends its rate-limit headers on every answer, as they stand
	// when the answer starts; model is known once the body is read.
	var model string
	var modelKnown bool
	if s.limits != nil {
		sw.before = func(h http.Header) {
			clearRateHeaders(h)
			d.rateHeaders(h, s.limits.state(model, modelKnown))
		}
	}

	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			d.writeError(w, d.errorOf(errTooLarge, "", nil))
			return
		}
		panic(http.ErrAbortHandler) // the client went away mid-body
	}
	req, perr := d.parse(body)
	if perr != nil {
		model, modelKnown = sniffModel(body)
		d.writeError(w, *perr)
		return
	}
	model, modelKnown = req.Model, true

	// Admission comes first: a request over a rate limit is refused before any fault,
	// and takes nothing. adm is nil without limits.
	var adm *admission
	if s.limits != nil {
		var rej *rejection
		adm, rej = s.limits.admit(req.Model, llm.EstimateTokens(req.request()))
		if rej != nil {
			s.mu.Lock()
			s.stats.RateLimited++
			if key != "" {
				s.stats.RateLimitedByIdempotencyKey[key]++
			}
			s.mu.Unlock()
			s.log.DebugContext(ctx, "fake-llm rate limited", "endpoint", d.endpoint(), "model", req.Model, "limit", rej.kind, "wait", rej.wait)
			d.writeError(w, d.rateLimited(*rej, req))
			return
		}
	}

	fault := s.nextFault()
	s.log.DebugContext(ctx, "fake-llm request", "endpoint", d.endpoint(), "model", req.Model, "stream", req.Stream, "fault", string(fault.Kind))
	switch fault.Kind {
	case FaultHang:
		s.wait(ctx, -1)
		panic(http.ErrAbortHandler) // never answer: close the connection once released
	case Fault429, Fault503, FaultQuota:
		if fault.Kind == Fault429 {
			adm.cancel() // a 429 takes nothing
		} else {
			adm.settle(0) // an error answer uses no tokens
		}
		kind := map[FaultKind]errKind{Fault429: errRateLimit, Fault503: errOverloaded, FaultQuota: errQuota}[fault.Kind]
		e := d.errorOf(kind, strconv.Itoa(int(s.cfg.RetryAfter.Round(time.Second)/time.Second)), req)
		for k, vs := range fault.Header {
			if strings.EqualFold(k, "Retry-After") && e.header != nil {
				e.header.Del("Retry-After")
			}
			for _, v := range vs {
				w.Header().Add(k, v)
			}
		}
		d.writeError(w, e)
		return
	case FaultMalformed:
		adm.settle(0)
		b := []byte(`{"id":"broken","object":"chat.completion","choices":[{"index":0,"message":{"role":"assis`)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(b)
		return
	}
	if s.cfg.MaxInputChars > 0 && req.inputChars() > s.cfg.MaxInputChars {
		adm.settle(0)
		d.writeError(w, d.errorOf(errContextLength, fmt.Sprintf("%d|%d", s.cfg.MaxInputChars, req.inputChars()), req))
		return
	}
	if perr := s.decide(ctx, req, d); perr != nil {
		adm.settle(0)
		d.writeError(w, *perr)
		return
	}

	rec, replayed, alive := s.answer(ctx, req, d, key)
	if !alive {
		panic(http.ErrAbortHandler) // the client left while the answer was being produced: it keeps its charge
	}
	if rec == nil {
		adm.settle(0)
		d.writeError(w, d.errorOf(errConflict, "", req))
		return
	}
	for k, vs := range fault.Header {
		w.Header()[k] = vs
	}
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	s.send(ctx, w, rec, fault.Kind, d, adm)
}

// answer returns the answer to req, produced in Config.Latency: the first answer to a
// repeated key when HonourIdempotency is on (replayed true; no latency), or a new one.
// rec is nil when another request with the same key is still being answered; alive is
// false when the client left (or Close was called) during the latency.
func (s *Server) answer(ctx context.Context, req *chatRequest, d dialect, key string) (rec *recorded, replayed, alive bool) {
	produce := func() *recorded {
		if s.cfg.Latency > 0 && !s.wait(ctx, s.cfg.Latency) {
			return nil
		}
		c := s.generate(req, d)
		rec := d.render(req, c)
		rec.usage = c.InTokens + c.OutToken
		return rec
	}
	if !s.cfg.HonourIdempotency || key == "" {
		rec = produce()
		return rec, false, rec != nil
	}
	ck := d.endpoint() + "|" + strconv.FormatBool(req.Stream) + "|" + key
	s.mu.Lock()
	if prev, ok := s.replays[ck]; ok {
		if prev != nil {
			s.stats.Replayed++
		}
		s.mu.Unlock()
		return prev, prev != nil, true
	}
	s.replays[ck] = nil // reserved while we answer: a repeat now gets 409
	s.mu.Unlock()
	rec = produce()
	s.mu.Lock()
	defer s.mu.Unlock()
	if rec == nil {
		delete(s.replays, ck)
		return nil, false, false
	}
	s.replays[ck] = rec // recorded once produced, even if sending it fails
	return rec, false, true
}

// generate produces a fresh answer to req: its tool calls, each with an id
// (Config.ToolCallIDs), its scripted text, or the summary of its prompt (with a
// sample tag when its temperature is above 0).
func (s *Server) generate(req *chatRequest, d dialect) completion {
	s.mu.Lock()
	c := completion{ID: d.idPrefix() + s.randAlnum(24), Created: time.Now().Unix(), Model: req.Model}
	var sample string
	if req.Temperature != nil && *req.Temperature > 0 {
		sample = s.randAlnum(8) // a summary's sample tag, drawn for every such request
	}
	random := s.cfg.ToolCallIDs == ToolCallIDsRandom
	for _, call := range req.Calls {
		if random {
			call.ID = d.toolIDPrefix() + s.randAlnum(24)
		}
		c.Tools = append(c.Tools, call)
	}
	s.mu.Unlock()

	switch {
	case len(c.Tools) > 0:
		if !random { // stable: derived from the request and the call's place in the answer
			h := fake.RequestHash(&llm.Request{Model: req.Model, Messages: req.Messages, Tools: req.Tools, Temperature: req.Temperature, MaxTokens: req.MaxTokens})
			for j := range c.Tools {
				c.Tools[j].ID = d.toolIDPrefix() + stableToolID(h, j)
			}
		}
	case req.Text != nil:
		c.Content = *req.Text
	default:
		c.Content = fake.Summary(fake.Prompt(req.Messages))
		if sample != "" {
			c.Content += " [sample " + sample + "]"
		}
	}
	c.InTokens = (req.inputChars() + 3) / 4
	out := c.Content
	for _, t := range c.Tools {
		out += t.Name + t.Arguments
	}
	c.OutToken = fake.EstimateTokens(out)
	return c
}

// stableToolID is the id (without its prefix) of the j-th tool call of an answer to
// the request of hash h (hex): the first 24 digits of h for the first call, of the
// hash of h and j for a later one.
func stableToolID(h string, j int) string {
	if j > 0 {
		sum := sha256.Sum256([]byte(h + "/" + strconv.Itoa(j)))
		h = hex.EncodeToString(sum[:])
	}
	return h[:24]
}

// nextFault returns the forced fault, else takes the next scripted one, else draws one
// from the probabilities.
func (s *Server) nextFault() Fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	var f Fault
	if s.forced != FaultNone {
		f.Kind = s.forced
	} else if len(s.script) > 0 {
		f, s.script = s.script[0], s.script[1:]
	} else {
		for _, c := range []struct {
			p    float64
			kind FaultKind
		}{{s.cfg.Hang, FaultHang}, {s.cfg.Fail429, Fault429}, {s.cfg.Fail503, Fault503}, {s.cfg.FailQuota, FaultQuota},
			{s.cfg.Drip, FaultDrip}, {s.cfg.DropStream, FaultDrop}} {
			if c.p > 0 && s.rng.Float64() < c.p {
				f.Kind = c.kind
				break
			}
		}
	}
	if f.Kind != FaultNone {
		s.stats.ByFault[string(f.Kind)]++
	}
	return f
}

// send writes rec, normally or with a write fault (drip, drop), and settles adm once
// the answer is complete: to rec's usage, or to nothing for a stream that ends with an
// error event. An answer cut short (dropped, or its client gone) keeps its charge.
func (s *Server) send(ctx context.Context, w http.ResponseWriter, rec *recorded, kind FaultKind, d dialect, adm *admission) {
	for k, vs := range rec.header {
		w.Header()[k] = vs
	}
	body := rec.body
	if !rec.sse {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	}
	rc := http.NewResponseController(w)
	switch kind {
	case FaultDrip:
		w.WriteHeader(http.StatusOK)
		_ = rc.Flush()
		for i := range body {
			if !s.wait(ctx, s.cfg.DripInterval) {
				panic(http.ErrAbortHandler)
			}
			if _, err := w.Write(body[i : i+1]); err != nil {
				panic(http.ErrAbortHandler)
			}
			if rc.Flush() != nil {
				panic(http.ErrAbortHandler)
			}
			s.mu.Lock()
			s.stats.DrippedBytes++
			s.mu.Unlock()
		}
		adm.settle(rec.usage)
	case FaultStreamError:
		if rec.sse {
			w.WriteHeader(http.StatusOK)
			cut := halfEvents(body)
			_, _ = w.Write(body[:cut])
			_, _ = w.Write(d.errorEvent(bytes.Count(body[:cut], []byte("\n\n"))))
			_ = rc.Flush()
			adm.settle(0)
			return
		}
		adm.settle(rec.usage)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(body)
	case FaultDrop:
		cut := len(body) / 2
		if rec.sse {
			cut = halfEvents(body)
		}
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(body[:cut])
		_ = rc.Flush()
		panic(http.ErrAbortHandler) // close the connection halfway
	default:
		if !rec.sse {
			adm.settle(rec.usage) // before the headers, so that they count it
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(body)
			return
		}
		w.WriteHeader(http.StatusOK)
		for len(body) > 0 {
			i := bytes.Index(body, []byte("\n\n"))
			if i < 0 {
				i = len(body) - 2
			}
			if _, err := w.Write(body[:i+2]); err != nil {
				return
			}
			_ = rc.Flush()
			body = body[i+2:]
		}
		adm.settle(rec.usage)
	}
}

// halfEvents returns the offset just after the middle event of an SSE body.
func halfEvents(body []byte) int {
	n := bytes.Count(body, []byte("\n\n"))
	off := 0
	for range max(n/2, 1) {
		i := bytes.Index(body[off:], []byte("\n\n"))
		if i < 0 {
			break
		}
		off += i + 2
	}
	return off
}

// wait sleeps for d (forever when d < 0) and reports whether it slept fully: false when
// the client went away or Close was called.
func (s *Server) wait(ctx context.Context, d time.Duration) bool {
	var timer <-chan time.Time
	if d >= 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timer = t.C
	}
	select {
	case <-ctx.Done():
		return false
	case <-s.stop.Done():
		return false
	case <-timer:
		return true
	}
}

const alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

// randAlnum and randHex draw from s.rng; s.mu must be held.
func (s *Server) randAlnum(n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = alnum[s.rng.IntN(len(alnum))]
	}
	return string(b)
}

func (s *Server) randHex(n int) string {
	const hexdig = "0123456789abcdef"
	b := make([]byte, n)
	for i := range b {
		b[i] = hexdig[s.rng.IntN(16)]
	}
	return string(b)
}

// statusWriter counts the status of every answer in Stats.ByStatus, and calls before,
// when set, on the headers just before they are sent.
type statusWriter struct {
	http.ResponseWriter
	s      *Server
	wrote  bool
	before func(http.Header)
}

func (w *statusWriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		if w.before != nil {
			w.before(w.ResponseWriter.Header())
		}
		w.s.mu.Lock()
		w.s.stats.ByStatus[strconv.Itoa(code)]++
		w.s.mu.Unlock()
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach Flush.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
