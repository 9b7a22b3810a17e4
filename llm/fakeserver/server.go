// Package fakeserver is a model server for demos and tests: it speaks OpenAI's Chat
// Completions wire format (POST /v1/chat/completions, plain and server-sent events,
// GET /v1/models), OpenAI's Responses API (POST /v1/responses, plain and named
// events ending in response.completed) and Anthropic's Messages format (POST
// /v1/messages, plain and events) with faults injected at will, and reports what it
// received on GET /stats. `onceflow fake-llm` serves it; tests start it in-process
// with httptest.
//
// Answers are deterministic for a given prompt: the summary of package fake (a tag
// derived from the prompt and its first words), or, when the request carries tools, a
// tool call: by default to the first tool with deterministic arguments, or to the tool
// and with the arguments Config.ToolChoice picks (which may pick none, for a text
// answer). Without a script, the request's own tool_choice wins, as on the real
// providers: OpenAI's "none", "auto", "required" and
// {"type":"function","function":{"name":...}} (on the Responses API
// {"type":"function","name":...}, and a hosted tool's choice gets text), Anthropic's
// {"type":"none"|"auto"|"any"|"tool","name":...}. The prompt is the last user message,
// whichever the dialect (a Responses API input that is a string is one), so the three
// endpoints give the same summary; the Responses API puts it in a message item, and a
// tool call in a function_call item. A request with a temperature above 0 models
// sampling: its summary also ends with a random sample tag. Ids are fresh for every
// response unless HonourIdempotency replays the first response to a repeated
// Idempotency-Key.
//
// Config.Script (`onceflow fake-llm --script FILE`, read with ParseScript) makes the
// server a scripted model for agent loops instead: a request is answered with the turn
// whose index is the number of tool results in its conversation (the last turn once
// the script is exhausted), its tool calls or its text as written, whatever the
// request's tools, tool_choice and temperature, and ahead of Config.ToolChoice.
//
// Faults, each a probability from 0 to 1 drawn per request in this order: Hang (never
// answers until the client goes away), Fail429 (429 with Retry-After and a
// provider-shaped rate-limit body), Fail503 (503 server_error; 529 overloaded_error on
// the Anthropic endpoint), FailQuota (429 insufficient_quota, which must not be
// retried), Drip (the whole answer one byte per DripInterval) and DropStream (the
// connection closes halfway through the answer: a stream after half its events, so a
// Responses stream never reaches response.completed; a plain answer after half its
// bytes). Script queues exact faults for the next requests ahead of the
// probabilities, for tests. Force (Config.Fault at start, or at run time POST /_fault
// with {"fault": "fail_503"}, and {"fault": ""} to end it) answers every request with
// one fault, ahead of the script and the probabilities: an outage of the provider that
// a chaos run switches on and off. GET /_fault reports the forced fault. The /_fault
// endpoint is outside the providers' wire paths (/v1/...). Every request counts in
// /stats, faulted or not.
//
// Rate limits (Config.RPM, Config.TPM) are enforced per model the way OpenAI enforces
// them, with the accounting of package limiter: a request bucket and a token bucket
// per model, each holding one minute of its limit and refilling continuously; a
// request costs one request and, on arrival, llm.EstimateTokens of it (capped at the
// token limit), corrected by the answer's usage once the answer is complete (an error
// answer uses none; an answer cut short keeps its charge). A request either bucket
// cannot pay gets a 429 (OpenAI's rate_limit_exceeded of type "requests" or "tokens"
// with Retry-After and retry-after-ms; Anthropic's rate_limit_error with retry-after)
// ahead of any fault, and takes nothing. Every answer of a model endpoint of a limited
// server carries the limits' headers: OpenAI's x-ratelimit-{limit,remaining,reset}-
// {requests,tokens} (on both OpenAI endpoints), Anthropic's anthropic-ratelimit-
// {requests,tokens}-{limit,remaining,reset}, those of the configured limits only;
// llm.ParseRateLimit reads them.
//
// Batches: the server also serves OpenAI's Batch API (POST /v1/files with
// purpose=batch, POST and GET /v1/batches, GET /v1/batches/{id}, POST
// /v1/batches/{id}/cancel, GET /v1/files/{id} and /v1/files/{id}/content) for the
// Chat Completions and Responses endpoints, and Anthropic's Message Batches (POST and
// GET /v1/messages/batches, GET and DELETE /v1/messages/batches/{id}, POST
// /v1/messages/batches/{id}/cancel, GET /v1/messages/batches/{id}/results), in their
// wire formats. A batch ends Config.BatchDelay after its creation on Config.Clock;
// each of its requests is answered as its synchronous endpoint answers the same body
// (faults, latency and rate limits apply to the synchronous endpoints only), except
// those Config.BatchFailEvery and Config.BatchExpireEvery pick by custom_id
// (Config.BatchOutcome). A batch expires when Config.BatchWindow ends first, and a
// cancel cuts the requests not yet done. Results are unordered, as the providers
// warn. Batches and files are visible to the credential (x-api-key or
// Authorization) that created them only. Stats counts the requests submitted per
// custom_id (BatchByCustomID) and those billed (BatchBilledByCustomID).
package fakeserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/onceflow/onceflow/llm"
)

// Tool-call id modes for Config.ToolCallIDs.
const (
	// ToolCallIDsRandom gives every tool call a fresh id, as real providers do.
	ToolCallIDsRandom = "random"
	// ToolCallIDsStable derives the id from the request, so a repeated request gets
	// the same id.
	ToolCallIDsStable = "stable"
)

// Defaults of Config's fields.
const (
	DefaultRetryAfter   = time.Second
	DefaultDripInterval = time.Second
	// MaxBodyBytes bounds a request body; larger ones get 413.
	MaxBodyBytes = 10 << 20
)

// DefaultModels are the models GET /v1/models lists.
var DefaultModels = []string{"gpt-4.1-mini", "gpt-4.1", "gpt-4o-mini", "claude-sonnet-4-5", "claude-haiku-4-5"}

// Config configures a Server. The zero value answers every request correctly at once.
type Config struct {
	// Latency is the time to produce an answer (error faults answer at once). Default: 0.
	Latency time.Duration
	// Fail429, Fail503, FailQuota, Hang, Drip and DropStream are fault probabilities
	// in [0, 1] (see the package documentation). Default: 0.
	Fail429, Fail503, FailQuota, Hang, Drip, DropStream float64
	// RetryAfter is the Retry-After of a 429 (and of Anthropic's 529), sent in whole
	// seconds. Default: 1s.
	RetryAfter time.Duration
	// MaxInputChars, when positive, makes requests whose messages (system included)
	// hold more characters answer 400 context_length_exceeded. Default: 0 (no limit).
	MaxInputChars int
	// HonourIdempotency replays the first successful response to a repeated
	// Idempotency-Key (same id, same content, Idempotent-Replayed: true); a repeat
	// while the first is still being answered gets 409. Default: false (keys are
	// counted but ignored, like most providers).
	HonourIdempotency bool
	// ToolCallIDs is ToolCallIDsRandom or ToolCallIDsStable. Default: random.
	ToolCallIDs string
	// ToolChoice picks the tool call that answers a request declaring tools (see
	// ToolChooser; CallTool and NoToolCalls are the common ones). The request's own
	// tool_choice wins over it: "none" gets text, a named tool gets a call to that
	// tool, "required" (Anthropic's "any") gets a call even when ToolChoice picks none
	// (to the first tool). It is not called when Script is set. Default: nil, a call to
	// the first tool with deterministic arguments.
	ToolChoice ToolChooser
	// Script, when not empty, answers every request to a model endpoint with turn i
	// of the script, i being the number of tool results in the request's conversation
	// (the last turn once the script is exhausted): `onceflow fake-llm --script FILE`,
	// read with ParseScript. A turn is answered as written, on every wire format, plain
	// or streamed: its tool calls (ids from ToolCallIDs, finish reason tool_calls,
	// Anthropic's stop_reason tool_use) or its text (stop, end_turn). It takes
	// precedence over ToolChoice, which is not called, and over the request's tools
	// and tool_choice: a scripted call is sent whether or not the request declares
	// its tool. Faults, latency, rate limits and replays apply as to any answer. (The
	// Server's Script method, which queues faults, is unrelated.) Default: none.
	Script []ScriptTurn
	// Fault, when set, is forced on every request from the start (see Force).
	// Default: FaultNone.
	Fault FaultKind
	// Seed seeds the random source of faults, ids and samples; 0 picks a random seed.
	Seed uint64
	// DripInterval is the pause between two bytes of a dripped answer. Default: 1s.
	DripInterval time.Duration
	// Models are listed by GET /v1/models. Default: DefaultModels.
	Models []string
	// RPM and TPM, when positive, are rate limits enforced per model, in requests and
	// tokens (prompt and output) per minute (see the package documentation).
	// Default: 0, no limit.
	RPM, TPM int
	// BatchDelay is the time a batch of the batch endpoints takes, from its creation
	// to its end, on Clock: its requests are answered over the first four fifths of
	// it (see the package documentation). Default: 1s.
	BatchDelay time.Duration
	// BatchWindow is a batch's completion window, its expires_at: a batch not ended
	// that long after its creation expires then (make it shorter than BatchDelay to
	// test expiry). Default: 24h, the providers'.
	BatchWindow time.Duration
	// BatchFailEvery and BatchExpireEvery, when positive, make about one batch
	// request in N errored (a 500: OpenAI's server_error in the error file,
	// Anthropic's api_error) or expired (OpenAI's batch_expired in the error file,
	// Anthropic's expired), picked by a hash of its custom_id: Config.BatchOutcome
	// says which. Default: 0, none.
	BatchFailEvery, BatchExpireEvery int
	// BatchRetention is how long an ended batch, its results and its files are
	// kept, and an uploaded file no kept batch reads. Default: 1h.
	BatchRetention time.Duration
	// BatchMaxBytes bounds an uploaded batch input file (413 beyond) and the body of
	// a message batch. Default: DefaultBatchMaxBytes (32 MiB).
	BatchMaxBytes int64
	// BatchMaxStoredBytes bounds the bytes of files, requests and results the batch
	// endpoints keep; an upload or a batch beyond it gets a 429 until retention
	// frees some. Default: DefaultBatchMaxStoredBytes (512 MiB).
	BatchMaxStoredBytes int64
	// Clock is the batch endpoints' clock (creation, progress, expiry, retention);
	// tests move it to finish a batch without waiting. It must be safe for
	// concurrent use. Default: time.Now.
	Clock func() time.Time
	// Logger receives one debug line per request; nil means slog.Default().
	Logger *slog.Logger
}

// ToolChooser decides how the fake model answers a request that declares tools: call
// the tool name with args (a JSON object; nil means the deterministic arguments of
// the tool's schema, fake.ToolArguments), or, when ok is false, answer in text. A name
// the request does not declare gets a text answer, as a real model calls only the
// tools it is offered; arguments that are not a JSON object get a 400 naming the tool.
// It sees the parsed request (model, messages, tools; the prompt is
// fake.Prompt(req.Messages)), is called once per request that declares tools, and
// must be safe for concurrent use.
type ToolChooser func(req *llm.Request) (name string, args json.RawMessage, ok bool)

// CallTool returns the ToolChooser that calls tool name with args (nil: the
// deterministic arguments of its schema) whenever the request declares it, and
// answers in text otherwise: `onceflow fake-llm --tool NAME --tool-args JSON`.
func CallTool(name string, args json.RawMessage) ToolChooser {
	return func(*llm.Request) (string, json.RawMessage, bool) { return name, args, true }
}

// NoToolCalls is the ToolChooser that never calls a tool: every answer is text, as
// when the model decides it needs none (`onceflow fake-llm --no-tool-calls`). A
// request whose tool_choice requires a call still gets one.
func NoToolCalls(*llm.Request) (string, json.RawMessage, bool) { return "", nil, false }

// Validate reports the first invalid field; an invalid Script matches
// ErrInvalidScript.
func (c Config) Validate() error {
	for name, p := range map[string]float64{"fail-429": c.Fail429, "fail-503": c.Fail503, "fail-quota": c.FailQuota,
		"hang": c.Hang, "drip": c.Drip, "drop-stream": c.DropStream} {
		if !(p >= 0 && p <= 1) {
			return fmt.Errorf("%s probability %v is not between 0 and 1", name, p)
		}
	}
	switch {
	case c.Latency < 0:
		return errors.New("latency must not be negative")
	case c.RetryAfter < 0:
		return errors.New("retry-after must not be negative")
	case c.MaxInputChars < 0:
		return errors.New("max-input-chars must not be negative")
	case c.RPM < 0:
		return errors.New("rpm must not be negative")
	case c.TPM < 0:
		return errors.New("tpm must not be negative")
	case c.DripInterval < 0:
		return errors.New("drip interval must not be negative")
	case c.ToolCallIDs != "" && c.ToolCallIDs != ToolCallIDsRandom && c.ToolCallIDs != ToolCallIDsStable:
		return fmt.Errorf("tool-call-ids %q: want stable or random", c.ToolCallIDs)
	}
	if err := c.validateBatch(); err != nil {
		return err
	}
	if err := checkScript(c.Script); err != nil {
		return err
	}
	return checkForcible(c.Fault)
}

// ErrUnknownFault is matched by the error of Force (and of Config.Validate, and the 400
// of POST /_fault) for a fault kind it cannot force.
var ErrUnknownFault = errors.New("unknown fault")

// ForcibleFaults are the kinds Force accepts, besides FaultNone.
var ForcibleFaults = []FaultKind{Fault429, Fault503, FaultQuota, FaultHang, FaultDrip, FaultDrop, FaultMalformed, FaultStreamError}

func checkForcible(k FaultKind) error {
	if k == FaultNone || slices.Contains(ForcibleFaults, k) {
		return nil
	}
	return fmt.Errorf("fault %q: %w (want one of %v, or empty)", k, ErrUnknownFault, ForcibleFaults)
}

// Server is the fake model server, an http.Handler safe for concurrent use.
type Server struct {
	cfg  Config
	log  *slog.Logger
	mux  *http.ServeMux
	stop context.Context // done when Close is called
	quit context.CancelFunc
	// limits are Config.RPM and Config.TPM; nil when neither is set.
	limits *rateLimits
	// turns are Config.Script, ready to answer; empty without a script.
	turns []turn

	mu     sync.Mutex
	rng    *rand.Rand
	script []Fault
	forced FaultKind
	stats  Stats
	// replays holds, per endpoint, stream mode and Idempotency-Key, the first answer
	// (nil while it is being produced).
	replays map[string]*recorded

	// batchStore holds the batch endpoints' batches and files; its own mutex is
	// taken before mu.
	batchStore batchStore
}

// recorded is an answer kept for replay.
type recorded struct {
	header http.Header
	body   []byte
	sse    bool
	// usage is the answer's tokens, input and output: what the rate limits' token
	// bucket is corrected to.
	usage int
}

// New returns a Server, or the first invalid field of cfg.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.RetryAfter == 0 {
		cfg.RetryAfter = DefaultRetryAfter
	}
	if cfg.DripInterval == 0 {
		cfg.DripInterval = DefaultDripInterval
	}
	if cfg.ToolCallIDs == "" {
		cfg.ToolCallIDs = ToolCallIDsRandom
	}
	if len(cfg.Models) == 0 {
		cfg.Models = DefaultModels
	}
	cfg = cfg.withBatchDefaults()
	seed := cfg.Seed
	if seed == 0 {
		seed = rand.Uint64() | 1 // #nosec G404 -- fault injection and fake ids, not secrets
	}
	s := &Server{
		cfg:        cfg,
		log:        cfg.Logger,
		mux:        http.NewServeMux(),
		rng:        rand.New(rand.NewPCG(seed, seed^0x5851f42d4c957f2d)), // #nosec G404 -- seeded faults, replayable
		replays:    map[string]*recorded{},
		stats:      newStats(),
		forced:     cfg.Fault,
		limits:     newRateLimits(cfg.RPM, cfg.TPM),
		turns:      compileScript(cfg.Script),
		batchStore: batchStore{batches: map[string]*batchRecord{}, files: map[string]*batchFile{}},
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	s.stop, s.quit = context.WithCancel(context.Background())
	s.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.model(w, r, openaiDialect{}) })
	s.mux.HandleFunc("POST /v1/responses", func(w http.ResponseWriter, r *http.Request) { s.model(w, r, responsesDialect{}) })
	s.mux.HandleFunc("POST /v1/messages", func(w http.ResponseWriter, r *http.Request) { s.model(w, r, anthropicDialect{}) })
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("POST /v1/files", s.uploadFile)
	s.mux.HandleFunc("GET /v1/files/{id}", s.getFile)
	s.mux.HandleFunc("GET /v1/files/{id}/content", s.fileContent)
	s.mux.HandleFunc("DELETE /v1/files/{id}", s.deleteFile)
	s.mux.HandleFunc("POST /v1/batches", s.createBatch)
	s.mux.HandleFunc("GET /v1/batches", s.listBatches)
	s.mux.HandleFunc("GET /v1/batches/{id}", s.getBatch)
	s.mux.HandleFunc("POST /v1/batches/{id}/cancel", s.cancelOABatch)
	s.mux.HandleFunc("POST /v1/messages/batches", s.createMessageBatch)
	s.mux.HandleFunc("GET /v1/messages/batches", s.listMessageBatches)
	s.mux.HandleFunc("GET /v1/messages/batches/{id}", s.getMessageBatch)
	s.mux.HandleFunc("DELETE /v1/messages/batches/{id}", s.deleteMessageBatch)
	s.mux.HandleFunc("POST /v1/messages/batches/{id}/cancel", s.cancelMessageBatch)
	s.mux.HandleFunc("GET /v1/messages/batches/{id}/results", s.messageBatchResults)
	s.mux.HandleFunc("GET /stats", s.statsHandler)
	s.mux.HandleFunc("GET /_fault", s.faultHandler)
	s.mux.HandleFunc("POST /_fault", s.faultHandler)
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		openaiDialect{}.writeError(w, apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "unknown_url",
			message: fmt.Sprintf("Unknown request URL: %s %s.", r.Method, r.URL.Path)})
	})
	return s, nil
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Close releases every hung, delayed or dripping request (their connections are
// closed without an answer) and makes later faulted requests end at once. Serving
// goes on; Close only lets an http.Server or httptest.Server shut down promptly.
func (s *Server) Close() { s.quit() }

// Script queues faults for the next requests to the model endpoints, in order, ahead
// of the configured probabilities; Fault{} (FaultNone) lets a request through.
func (s *Server) Script(faults ...Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.script = append(s.script, faults...)
}

// Force answers every later request to the model endpoints with a fault of kind k
// (one of ForcibleFaults), ahead of the script (which waits) and the probabilities,
// until Force(FaultNone). Requests already being answered are not affected. It fails
// with ErrUnknownFault for another kind. Safe for concurrent use.
func (s *Server) Force(k FaultKind) error {
	if err := checkForcible(k); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if k != s.forced {
		s.log.Info("fake-llm forced fault", "fault", string(k), "previous", string(s.forced))
	}
	s.forced = k
	return nil
}

// Forced returns the fault Force set (FaultNone when none).
func (s *Server) Forced() FaultKind {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.forced
}

// faultHandler serves /_fault: GET reports the forced fault, POST {"fault": KIND}
// forces one ("" ends it); both answer {"fault": KIND}.
func (s *Server) faultHandler(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPost {
		var in struct {
			Fault *FaultKind `json:"fault"`
		}
		dec := json.NewDecoder(io.LimitReader(r.Body, 4096))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&in); err != nil || in.Fault == nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"detail": `want {"fault": KIND}, KIND "" to end a forced fault`})
			return
		}
		if err := s.Force(*in.Fault); err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"detail": err.Error()})
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]FaultKind{"fault": s.Forced()})
}

// SetFault forces kind on the server at baseURL (with or without a trailing /v1)
// through POST /_fault, using client (nil: http.DefaultClient); FaultNone ends it.
func SetFault(ctx context.Context, client *http.Client, baseURL string, kind FaultKind) error {
	if client == nil {
		client = http.DefaultClient
	}
	body, _ := json.Marshal(map[string]FaultKind{"fault": kind})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, rootURL(baseURL)+"/_fault", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("set fault %q: %w", kind, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return fmt.Errorf("set fault %q: HTTP %d: %s", kind, resp.StatusCode, bytes.TrimSpace(b))
	}
	return nil
}

// Stats is what GET /stats reports.
type Stats struct {
	// Requests counts requests to the model endpoints, faulted or not, on arrival.
	Requests int64 `json:"requests"`
	// ByStatus counts answers by HTTP status ("200", "429"); a hung request has none.
	ByStatus map[string]int64 `json:"by_status"`
	// ByIdempotencyKey counts requests per Idempotency-Key header value.
	ByIdempotencyKey map[string]int64 `json:"by_idempotency_key"`
	// ByFault counts injected faults by kind (fail_429, hang, drip, ...).
	ByFault map[string]int64 `json:"by_fault"`
	// ByEndpoint counts requests per endpoint ("chat_completions", "responses",
	// "messages").
	ByEndpoint map[string]int64 `json:"by_endpoint"`
	// DrippedBytes counts the bytes sent by dripping answers.
	DrippedBytes int64 `json:"dripped_bytes"`
	// Replayed counts answers replayed for a repeated Idempotency-Key.
	Replayed int64 `json:"replayed"`
	// InFlight is the number of requests being answered now.
	InFlight int64 `json:"in_flight"`
	// RateLimited counts the 429s of the rate limits (Config.RPM, Config.TPM); the
	// injected ones count in ByFault.
	RateLimited int64 `json:"rate_limited"`
	// RateLimitedByIdempotencyKey counts those 429s per Idempotency-Key header value
	// (requests without one count in RateLimited only): which calls met the limit,
	// where the model does not tell (a shadow of production's own model). An
	// onceflow model call sends its ledger key, whose llm_calls row names the job and
	// step (its work column).
	RateLimitedByIdempotencyKey map[string]int64 `json:"rate_limited_by_idempotency_key"`
	// BatchByCustomID counts, per custom_id, the requests submitted in any batch of
	// either provider, on creation (OpenAI: the lines of the input file whose
	// custom_id could be read, even in a file that fails validation). A custom_id
	// submitted twice counts 2, whether or not its first batch ran.
	BatchByCustomID map[string]int64 `json:"batch_by_custom_id"`
	// BatchBilledByCustomID counts, per custom_id, the batch requests that
	// succeeded: those a provider bills. An errored, expired or cancelled request
	// is not billed.
	BatchBilledByCustomID map[string]int64 `json:"batch_billed_by_custom_id"`
	// BatchesCreated counts the batches created per provider ("openai",
	// "anthropic").
	BatchesCreated map[string]int64 `json:"batches_created"`
	// BatchItems counts the requests of ended batches by outcome ("succeeded",
	// "errored", "expired", "canceled"), once each, when their batch ends.
	BatchItems map[string]int64 `json:"batch_items"`
	// BatchesCancelled counts the cancels accepted, of either provider.
	BatchesCancelled int64 `json:"batches_cancelled"`
	// FilesUploaded counts the files uploaded with purpose batch (OpenAI), and
	// FilesHeld those of them not deleted yet: what a client leaves at the provider.
	FilesUploaded int64 `json:"files_uploaded"`
	FilesHeld     int64 `json:"files_held"`
}

func newStats() Stats {
	return Stats{ByStatus: map[string]int64{}, ByIdempotencyKey: map[string]int64{}, ByFault: map[string]int64{}, ByEndpoint: map[string]int64{},
		RateLimitedByIdempotencyKey: map[string]int64{}, BatchByCustomID: map[string]int64{}, BatchBilledByCustomID: map[string]int64{},
		BatchesCreated: map[string]int64{}, BatchItems: map[string]int64{}}
}

// Stats returns a copy of the counters, after producing the results of the batches
// that have ended (so that their requests count without a client polling).
func (s *Server) Stats() Stats {
	s.settleBatches()
	var held int64
	st := &s.batchStore
	st.mu.Lock()
	for _, f := range st.files {
		if f.batch == "" {
			held++
		}
	}
	st.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.stats
	c.ByStatus, c.ByIdempotencyKey, c.ByFault, c.ByEndpoint = clone(c.ByStatus), clone(c.ByIdempotencyKey), clone(c.ByFault), clone(c.ByEndpoint)
	c.RateLimitedByIdempotencyKey = clone(c.RateLimitedByIdempotencyKey)
	c.BatchByCustomID, c.BatchBilledByCustomID = clone(c.BatchByCustomID), clone(c.BatchBilledByCustomID)
	c.BatchesCreated, c.BatchItems = clone(c.BatchesCreated), clone(c.BatchItems)
	c.FilesHeld = held
	return c
}

func clone(m map[string]int64) map[string]int64 {
	out := make(map[string]int64, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func (s *Server) statsHandler(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.Stats())
}

// FetchStats reads GET /stats of the server at baseURL (with or without a trailing
// /v1), using client (nil: http.DefaultClient).
func FetchStats(ctx context.Context, client *http.Client, baseURL string) (Stats, error) {
	if client == nil {
		client = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rootURL(baseURL)+"/stats", nil)
	if err != nil {
		return Stats{}, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return Stats{}, fmt.Errorf("fetch stats: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Stats{}, fmt.Errorf("fetch stats: HTTP %d", resp.StatusCode)
	}
	var st Stats
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&st); err != nil {
		return Stats{}, fmt.Errorf("fetch stats: %w", err)
	}
	return st, nil
}

func rootURL(base string) string {
	for len(base) > 0 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	if len(base) >= 3 && base[len(base)-3:] == "/v1" {
		base = base[:len(base)-3]
	}
	return base
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list"}
	for _, m := range s.cfg.Models {
		list.Data = append(list.Data, model{ID: m, Object: "model", Created: 1735689600, OwnedBy: "onceflow-fake"})
	}
	writeJSON(w, http.StatusOK, list)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
