package fakeserver

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The batch endpoints (batch_openai.go: OpenAI's Batch API over uploaded files;
// batch_anthropic.go: Anthropic's Message Batches) share one store and one
// lifecycle, measured on Config.Clock:
//
//   - a batch is created at t0 and its requests are answered one after the other
//     over the first four fifths of Config.BatchDelay (request i of n is done at
//     t0 + 0.8·BatchDelay·(i+1)/n), then it ends at t0 + BatchDelay (OpenAI's
//     status is finalizing in between);
//   - a batch not ended at t0 + Config.BatchWindow (its expires_at) expires then:
//     the requests done by then keep their answers, the others are expired;
//   - a cancel at tc ends the batch at tc + BatchDelay/10 (OpenAI's cancelling,
//     Anthropic's canceling, in between): the requests done by tc keep their
//     answers, the others are cancelled;
//   - each request, when done, is answered as the synchronous endpoint answers the
//     same body (same parser, same answer, same usage; no faults, latency or rate
//     limits), unless Config.BatchExpireEvery or Config.BatchFailEvery picks it
//     (BatchOutcome).
//
// A batch's results are produced once, when it is first seen ended (by a request
// or by Stats), and kept until Config.BatchRetention after its end.

// Defaults and limits of the batch endpoints.
const (
	// DefaultBatchDelay is the default of Config.BatchDelay.
	DefaultBatchDelay = time.Second
	// DefaultBatchWindow is the default of Config.BatchWindow: the providers' 24
	// hours.
	DefaultBatchWindow = 24 * time.Hour
	// DefaultBatchRetention is the default of Config.BatchRetention.
	DefaultBatchRetention = time.Hour
	// DefaultBatchMaxBytes is the default of Config.BatchMaxBytes (OpenAI accepts
	// files of 200 MB, Anthropic batches of 256 MB; a fake keeps less).
	DefaultBatchMaxBytes = 32 << 20
	// DefaultBatchMaxStoredBytes is the default of Config.BatchMaxStoredBytes.
	DefaultBatchMaxStoredBytes = 512 << 20
	// MaxBatchFileLines is OpenAI's limit of requests in a batch input file.
	MaxBatchFileLines = 50_000
	// MaxMessageBatchRequests is Anthropic's limit of requests in a message batch.
	MaxMessageBatchRequests = 100_000
	// MaxStoredBatches bounds the batches and files the server keeps at once; a
	// creation or upload beyond it gets a 429 until retention frees some.
	MaxStoredBatches = 10_000
)

// Outcomes of a batch request: the result types of Anthropic's Message Batches, the
// keys of Stats.BatchItems and the values of Config.BatchOutcome. On OpenAI's Batch
// API a succeeded request is a line of the output file, an errored or expired one a
// line of the error file, and a cancelled one is in neither.
const (
	BatchSucceeded = "succeeded"
	BatchErrored   = "errored"
	BatchExpired   = "expired"
	BatchCanceled  = "canceled"
)

// BatchOutcome is the outcome Config.BatchExpireEvery and Config.BatchFailEvery give
// the batch request custom_id whatever its batch, provider or position: BatchExpired
// when BatchExpireEvery picks it, else BatchErrored when BatchFailEvery picks it,
// else BatchSucceeded (which a request the endpoint refuses, or one its batch
// expires or cancels before it is done, does not reach). N picks a custom_id when
// its FNV-1a hash, salted per knob, is a multiple of N: about one in N, the same
// ones every run, so tests predict them with this method.
func (c Config) BatchOutcome(customID string) string {
	switch {
	case c.BatchExpireEvery > 0 && pickedBy("expire/", customID, c.BatchExpireEvery):
		return BatchExpired
	case c.BatchFailEvery > 0 && pickedBy("fail/", customID, c.BatchFailEvery):
		return BatchErrored
	}
	return BatchSucceeded
}

// pickedBy reports whether customID is one of the about one in every (> 0) that salt
// picks, by a hash.
func pickedBy(salt, customID string, every int) bool {
	h := fnv.New64a()
	_, _ = h.Write([]byte(salt + customID))
	return h.Sum64()%uint64(every) == 0 // #nosec G115 -- every > 0: its callers check
}

// orderKey is the place of customID's result in the results of batch id: results
// are unordered, as the providers warn, but the same for a batch every time.
func orderKey(id, customID string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(id + "/" + customID))
	return h.Sum64()
}

// validateBatch reports the first invalid batch field of c.
func (c Config) validateBatch() error {
	switch {
	case c.BatchDelay < 0:
		return errors.New("batch-delay must not be negative")
	case c.BatchWindow < 0:
		return errors.New("batch-window must not be negative")
	case c.BatchRetention < 0:
		return errors.New("batch-retention must not be negative")
	case c.BatchFailEvery < 0:
		return errors.New("batch-fail-every must not be negative")
	case c.BatchExpireEvery < 0:
		return errors.New("batch-expire-every must not be negative")
	case c.BatchMaxBytes < 0:
		return errors.New("batch-max-bytes must not be negative")
	case c.BatchMaxStoredBytes < 0:
		return errors.New("batch-max-stored-bytes must not be negative")
	}
	return nil
}

// withBatchDefaults returns c with the batch defaults applied.
func (c Config) withBatchDefaults() Config {
	c.BatchDelay = cmp.Or(c.BatchDelay, DefaultBatchDelay)
	c.BatchWindow = cmp.Or(c.BatchWindow, DefaultBatchWindow)
	c.BatchRetention = cmp.Or(c.BatchRetention, DefaultBatchRetention)
	c.BatchMaxBytes = cmp.Or(c.BatchMaxBytes, DefaultBatchMaxBytes)
	c.BatchMaxStoredBytes = cmp.Or(c.BatchMaxStoredBytes, DefaultBatchMaxStoredBytes)
	if c.Clock == nil {
		c.Clock = time.Now
	}
	return c
}

// Batch providers, the keys of Stats.BatchesCreated.
const (
	providerOpenAI    = "openai"
	providerAnthropic = "anthropic"
)

// batchStore holds the batches and files of the batch endpoints. Its mutex is taken
// before Server.mu, never while holding it.
type batchStore struct {
	mu      sync.Mutex
	seq     uint64
	batches map[string]*batchRecord
	files   map[string]*batchFile
	// stored counts the bytes of files and of Anthropic requests kept.
	stored int64
}

// batchFile is a file of OpenAI's Files API: an uploaded input, or a batch's output
// or error file.
type batchFile struct {
	id, owner, filename, purpose string
	created                      time.Time
	data                         []byte
	// batch is the batch whose output this is ("" for an upload); it goes with it.
	batch string
}

// batchItem is one request of a batch.
type batchItem struct {
	customID string
	body     []byte
}

// batchRecord is one batch of either provider.
type batchRecord struct {
	id, provider, owner string
	seq                 uint64
	created             time.Time
	delay, window       time.Duration
	items               []batchItem
	// size is what the record counts in batchStore.stored (Anthropic's requests;
	// OpenAI's are in the input file).
	size int64
	// OpenAI only: the endpoint, the input file, the model of its requests, the
	// metadata, and the errors of a file that failed validation.
	endpoint, inputFile, model string
	metadata                   map[string]string
	invalid                    []oaLineError
	// cancelAt is when a cancel was asked (zero: never).
	cancelAt time.Time

	// Set once the batch has ended and its results are produced.
	ended   bool
	results []itemResult // in result order
	counts  map[string]int64
	usage   [2]int64 // input and output tokens of the succeeded requests
	// outputFile and errorFile are OpenAI's files of the results ("" when empty).
	outputFile, errorFile string
}

// itemResult is the result of one batch request.
type itemResult struct {
	customID string
	outcome  string
	// status and body are the answer the synchronous endpoint would have sent
	// (succeeded and errored requests; an errored one picked by BatchFailEvery gets
	// the provider's server error); requestID is its request id.
	status    int
	body      []byte
	apiErr    *apiError
	requestID string
}

// endAt is when b ends: at once for a file that failed validation, BatchDelay/10
// after a cancel, else at the first of its delay and its window.
func (b *batchRecord) endAt() time.Time {
	switch {
	case len(b.invalid) > 0:
		return b.created
	case !b.cancelAt.IsZero():
		return b.cancelAt.Add(b.delay / 10)
	}
	return b.created.Add(min(b.delay, b.window))
}

// finalizingAt is when every request of b is done (OpenAI's finalizing).
func (b *batchRecord) finalizingAt() time.Time { return b.created.Add(b.delay * 4 / 5) }

// doneAt is when request i of b is done.
func (b *batchRecord) doneAt(i int) time.Time {
	return b.created.Add(time.Duration(float64(b.delay) * 0.8 * float64(i+1) / float64(len(b.items))))
}

// expired reports whether b's window ends before its delay (and no cancel came
// first).
func (b *batchRecord) expired() bool { return b.cancelAt.IsZero() && b.window < b.delay }

// cut is the time after which b's requests are not done: the cancel, the end of the
// window, or never.
func (b *batchRecord) cut() (time.Time, string) {
	switch {
	case !b.cancelAt.IsZero():
		return b.cancelAt, BatchCanceled
	case b.expired():
		return b.created.Add(b.window), BatchExpired
	}
	return time.Time{}, ""
}

// owner is the credential of r (x-api-key, else the token of Authorization:
// Bearer, so that a key sent either way is one credential), hashed: batches and
// files are visible to the credential that created them only, as they are to one
// organisation. A request without one is the owner "" (the fake does not check
// keys).
func owner(r *http.Request) string {
	k := r.Header.Get("X-Api-Key")
	if k == "" {
		a := r.Header.Get("Authorization")
		k = strings.TrimSpace(strings.TrimPrefix(a, "Bearer "))
	}
	if k == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(k))
	return hex.EncodeToString(sum[:8])
}

// errStoreFull is returned by admit when the store holds too much.
var errStoreFull = errors.New("batch store full")

// admit reserves room for one more record of size bytes, after dropping what
// retention allows; st.mu must be held.
func (s *Server) admit(now time.Time, size int64) error {
	st := &s.batchStore
	s.sweep(now)
	if len(st.batches)+len(st.files) >= MaxStoredBatches || st.stored+size > s.cfg.BatchMaxStoredBytes {
		return fmt.Errorf("%w: fake-llm keeps at most %d batches and files and %d bytes; ended batches are dropped %v after they end (--batch-retention)",
			errStoreFull, MaxStoredBatches, s.cfg.BatchMaxStoredBytes, s.cfg.BatchRetention)
	}
	return nil
}

// sweep drops the batches ended more than BatchRetention ago with their output
// files, and the uploaded files older than that which no kept batch reads;
// st.mu must be held.
func (s *Server) sweep(now time.Time) {
	st := &s.batchStore
	used := map[string]bool{}
	for id, b := range st.batches {
		if b.ended && now.Sub(b.endAt()) > s.cfg.BatchRetention {
			delete(st.batches, id)
			st.stored -= b.size
			continue
		}
		used[b.inputFile] = true
	}
	for id, f := range st.files {
		gone := f.batch != "" && st.batches[f.batch] == nil
		stale := f.batch == "" && !used[id] && now.Sub(f.created) > s.cfg.BatchRetention
		if gone || stale {
			delete(st.files, id)
			st.stored -= int64(len(f.data))
		}
	}
}

// addBatch stores b with the next sequence number and counts its requests in the
// stats; st.mu must be held.
func (s *Server) addBatch(b *batchRecord, customIDs []string) {
	st := &s.batchStore
	st.seq++
	b.seq = st.seq
	st.batches[b.id] = b
	st.stored += b.size
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stats.BatchesCreated[b.provider]++
	for _, id := range customIDs {
		s.stats.BatchByCustomID[id]++
	}
}

// lookup returns the batch id of provider visible to who, after producing its
// results if it has ended; st.mu must be held.
func (s *Server) lookup(id, provider, who string, now time.Time) *batchRecord {
	b := s.batchStore.batches[id]
	if b == nil || b.provider != provider || b.owner != who {
		return nil
	}
	s.settle(b, now)
	return b
}

// list returns the batches of provider visible to who, newest first, their results
// produced if they have ended; st.mu must be held.
func (s *Server) list(provider, who string, now time.Time) []*batchRecord {
	var out []*batchRecord
	for _, b := range s.batchStore.batches {
		if b.provider == provider && b.owner == who {
			s.settle(b, now)
			out = append(out, b)
		}
	}
	slices.SortFunc(out, func(a, b *batchRecord) int { return cmp.Compare(b.seq, a.seq) })
	return out
}

// settleBatches produces the results of every batch that has ended, so that Stats
// counts them without a client polling.
func (s *Server) settleBatches() {
	st := &s.batchStore
	st.mu.Lock()
	defer st.mu.Unlock()
	now := s.cfg.Clock()
	for _, b := range st.batches {
		s.settle(b, now)
	}
}

// settle produces b's results once it has ended at now: each request's outcome, in
// result order, its OpenAI files, and the stats; st.mu must be held.
func (s *Server) settle(b *batchRecord, now time.Time) {
	if b.ended || now.Before(b.endAt()) {
		return
	}
	b.ended = true
	b.counts = map[string]int64{}
	if len(b.invalid) > 0 {
		return
	}
	cut, cutOutcome := b.cut()
	d := batchDialect(b)
	for i, it := range b.items {
		r := itemResult{customID: it.customID}
		at := b.doneAt(i)
		switch {
		case !cut.IsZero() && at.After(cut):
			r.outcome = cutOutcome
		case s.cfg.BatchOutcome(it.customID) == BatchExpired:
			r.outcome = BatchExpired
		case s.cfg.BatchOutcome(it.customID) == BatchErrored:
			r.outcome = BatchErrored
			var e apiError
			if b.provider == providerAnthropic {
				e = apiError{status: http.StatusInternalServerError, typ: "api_error", message: "Internal server error"}
			} else {
				e = apiError{status: http.StatusInternalServerError, typ: "server_error",
					message: "The server had an error while processing your request. Sorry about that!"}
			}
			r.status, r.apiErr = e.status, &e
		default:
			r.status, r.body, r.apiErr = s.answerBatchItem(d, it.body, at, b.usage[:])
			r.outcome = BatchSucceeded
			if r.apiErr != nil {
				r.outcome = BatchErrored
			}
		}
		if r.outcome == BatchSucceeded || r.outcome == BatchErrored {
			s.mu.Lock()
			r.requestID = "req_" + s.randHex(32)
			s.mu.Unlock()
		}
		b.counts[r.outcome]++
		b.results = append(b.results, r)
	}
	slices.SortStableFunc(b.results, func(x, y itemResult) int {
		return cmp.Compare(orderKey(b.id, x.customID), orderKey(b.id, y.customID))
	})
	if b.provider == providerOpenAI {
		s.writeOutputFiles(b)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range b.results {
		s.stats.BatchItems[r.outcome]++
		if r.outcome == BatchSucceeded {
			s.stats.BatchBilledByCustomID[r.customID]++
		}
	}
}

// batchDialect is the dialect that answers b's requests.
func batchDialect(b *batchRecord) dialect {
	switch {
	case b.provider == providerAnthropic:
		return anthropicDialect{}
	case b.endpoint == "/v1/responses":
		return responsesDialect{}
	}
	return openaiDialect{}
}

// answerBatchItem answers one batch request body as the synchronous endpoint of d
// answers it (never streamed), produced at at: the answer's status and body, or the
// error the endpoint would send. The answer's tokens are added to usage (input,
// output).
func (s *Server) answerBatchItem(d dialect, body []byte, at time.Time, usage []int64) (int, []byte, *apiError) {
	req, perr := d.parse(body)
	if perr != nil {
		return perr.status, nil, perr
	}
	req.Stream, req.IncludeUsage = false, false
	if s.cfg.MaxInputChars > 0 && req.inputChars() > s.cfg.MaxInputChars {
		e := d.errorOf(errContextLength, fmt.Sprintf("%d|%d", s.cfg.MaxInputChars, req.inputChars()), req)
		return e.status, nil, &e
	}
	if perr := s.decide(context.Background(), req, d); perr != nil {
		return perr.status, nil, perr
	}
	c := s.generate(req, d)
	c.Created = at.Unix()
	usage[0] += int64(c.InTokens)
	usage[1] += int64(c.OutToken)
	return http.StatusOK, d.render(req, c).body, nil
}

// cancelBatch asks b to cancel at now: it reports false when b has ended or is
// already cancelling; st.mu must be held.
func (s *Server) cancelBatch(b *batchRecord, now time.Time) bool {
	if b.ended || !b.cancelAt.IsZero() {
		return false
	}
	b.cancelAt = now
	s.mu.Lock()
	s.stats.BatchesCancelled++
	s.mu.Unlock()
	return true
}

// newID returns prefix and n random letters and digits.
func (s *Server) newID(prefix string, n int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return prefix + s.randAlnum(n)
}

// writeBytes answers 200 with b, whose Content-Type the caller has set.
func writeBytes(w http.ResponseWriter, b []byte) {
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}
