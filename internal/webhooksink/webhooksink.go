// Package webhooksink is a webhook receiver for tests, demos and the chaos suite: it
// records every delivery with its Idempotency-Key and body, answers 2xx (or an injected
// failure, after an optional latency), and reports the counts that show whether an
// effect happened once per key. `onceflow webhook-sink` runs it as a process.
//
// A delivery is recorded when its request arrives, before the latency and the answer,
// the way a provider applies an effect and then the response is lost: a sender killed
// while waiting still counts as having delivered.
package webhooksink

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/onceflow/onceflow/internal/httpapi"
)

// Options configures a Sink. The zero value answers every POST 200 at once.
type Options struct {
	// Latency delays every answer (the delivery is recorded first). Default: none.
	Latency time.Duration
	// FailRate is the probability, 0 to 1, that a POST is answered with FailStatus
	// instead of being recorded. Default: 0.
	FailRate float64
	// FailStatus is the status of an injected failure. Default: 503.
	FailStatus int
	// RetryAfter, when positive, is sent as Retry-After (whole seconds) with injected
	// failures.
	RetryAfter time.Duration
	// Seed makes injected failures reproducible; 0 means random.
	Seed uint64
}

// Delivery is one recorded POST.
type Delivery struct {
	Key  string          `json:"idempotency_key"`
	Body json.RawMessage `json:"body"`
	At   time.Time       `json:"at"`
}

// Stats are the counts GET answers with.
type Stats struct {
	// Deliveries is the number of POSTs recorded (answered 2xx or to be).
	Deliveries int `json:"deliveries"`
	// DistinctKeys is the number of different Idempotency-Key values recorded.
	DistinctKeys int `json:"distinct_keys"`
	// Duplicates maps each key recorded more than once to its count.
	Duplicates map[string]int `json:"duplicates"`
	// Failed is the number of POSTs answered with an injected failure (not recorded).
	Failed int `json:"failed"`
	// MissingKey is the number of POSTs recorded without an Idempotency-Key.
	MissingKey int `json:"missing_key"`
}

// Sink records webhook deliveries. It is an http.Handler and safe for concurrent use.
type Sink struct {
	opts Options

	mu         sync.Mutex
	rng        *rand.Rand
	deliveries []Delivery
	byKey      map[string]int
	failed     int
	missingKey int
	failNext   int
	// answer, when set, makes the first POST of each Idempotency-Key answer its body,
	// and every later POST of the key replay that body (SetAnswer).
	answer  func(key string, body []byte) []byte
	answers map[string][]byte
}

// SetAnswer makes the sink answer like an API that honours Idempotency-Key: the first
// POST of each key gets the body answer returns for it (the effect's result: a refund's
// id), and every later POST of the same key gets that body again, with
// Idempotent-Replayed: true. A POST without a key gets a fresh answer. nil restores the
// plain {"status":"ok"}.
func (s *Sink) SetAnswer(answer func(key string, body []byte) []byte) {
	s.mu.Lock()
	s.answer, s.answers = answer, map[string][]byte{}
	s.mu.Unlock()
}

// New returns an empty Sink.
func New(opts Options) *Sink {
	if opts.FailStatus == 0 {
		opts.FailStatus = http.StatusServiceUnavailable
	}
	seed := opts.Seed
	if seed == 0 {
		seed = rand.Uint64() // #nosec G404 -- which deliveries fail, for tests and the demo: not a secret
	}
	return &Sink{opts: opts, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), byKey: map[string]int{}} // #nosec G404 -- as above
}

// FailNext makes the next n POSTs fail with FailStatus, whatever FailRate says.
func (s *Sink) FailNext(n int) {
	s.mu.Lock()
	s.failNext = n
	s.mu.Unlock()
}

// SetLatency changes the delay of the answers to come.
func (s *Sink) SetLatency(d time.Duration) {
	s.mu.Lock()
	s.opts.Latency = d
	s.mu.Unlock()
}

// ServeHTTP records a POST, or answers GET with the Stats as JSON (GET with
// ?deliveries=1 adds every delivery).
func (s *Sink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet:
		v := struct {
			Stats
			Deliveries []Delivery `json:"delivered,omitempty"`
		}{Stats: s.Stats()}
		if r.URL.Query().Get("deliveries") != "" {
			v.Deliveries = s.Deliveries()
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v)
	case http.MethodPost:
		s.post(w, r)
	default:
		http.Error(w, `{"detail":"method not allowed"}`, http.StatusMethodNotAllowed)
	}
}

func (s *Sink) post(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return // the sender went away mid-request: nothing arrived
	}
	key := r.Header.Get("Idempotency-Key")
	s.mu.Lock()
	fail := s.failNext > 0 || s.opts.FailRate > 0 && s.rng.Float64() < s.opts.FailRate
	if s.failNext > 0 {
		s.failNext--
	}
	if fail {
		s.failed++
	} else {
		if !json.Valid(body) {
			body, _ = json.Marshal(string(body))
		}
		s.deliveries = append(s.deliveries, Delivery{Key: key, Body: body, At: time.Now()})
		s.byKey[key]++
		if key == "" {
			s.missingKey++
		}
	}
	latency := s.opts.Latency
	var reply []byte
	replayed := false
	if !fail && s.answer != nil {
		if prev, ok := s.answers[key]; ok && key != "" {
			reply, replayed = prev, true
		} else {
			reply = s.answer(key, body)
			if key != "" {
				s.answers[key] = reply
			}
		}
	}
	s.mu.Unlock()
	if latency > 0 {
		t := time.NewTimer(latency)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	if fail {
		if s.opts.RetryAfter > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(int(s.opts.RetryAfter.Seconds())))
		}
		w.WriteHeader(s.opts.FailStatus)
		_, _ = io.WriteString(w, `{"detail":"injected failure"}`)
		return
	}
	if reply != nil {
		if replayed {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		_, _ = w.Write(reply)
		return
	}
	_, _ = io.WriteString(w, `{"status":"ok"}`)
}

// Stats returns the counts so far.
func (s *Sink) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Deliveries: len(s.deliveries), DistinctKeys: len(s.byKey), Duplicates: map[string]int{},
		Failed: s.failed, MissingKey: s.missingKey}
	for k, n := range s.byKey {
		if n > 1 {
			st.Duplicates[k] = n
		}
	}
	return st
}

// Count returns how many times key was delivered.
func (s *Sink) Count(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byKey[key]
}

// Deliveries returns a copy of every recorded delivery, in arrival order.
func (s *Sink) Deliveries() []Delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Delivery(nil), s.deliveries...)
}

// Keys returns the distinct keys delivered, sorted.
func (s *Sink) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys := make([]string, 0, len(s.byKey))
	for k := range s.byKey {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Serve serves s on ln until ctx is cancelled, then closes the listener and the open
// connections. The server is the one every onceflow listener runs
// (httpapi.NewHTTPServer), with lim: a client trickling its body is answered 408 and
// nothing is recorded for it. It logs "webhook sink listening" with the address.
func Serve(ctx context.Context, ln net.Listener, s *Sink, lim httpapi.Limits, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	srv := httpapi.NewHTTPServer(s, lim, log)
	log.InfoContext(ctx, "webhook sink listening", "addr", ln.Addr().String())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	_ = srv.Close()
	<-errc
	return nil
}
