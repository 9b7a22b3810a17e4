package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"hash"
	"maps"
	"net/http"
	"sync"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
)

// A request whose key is in flight joins the call instead of making another: it waits
// for the answer and gets the same bytes; for a stream, the bytes so far at once and
// then the live tail. A call this process makes is followed in memory (a flight); a
// call another gateway process makes is followed through its llm_calls row, polled
// (Ledger.Progress): the owner announces a stream's status and headers before the first
// batch of its output it persists (Attempt.Announce).

// Poll intervals of a joiner following a call on another process: from joinPollMin,
// growing by half at every poll without news, up to joinPollMax.
const (
	joinPollMin = 10 * time.Millisecond
	joinPollMax = 200 * time.Millisecond
)

// Header names of the gateway's own answers.
const (
	// HeaderJoined is set (to "true") on an answer that a request got by joining a call
	// in flight, with Idempotent-Replayed: true, as it made no upstream call.
	HeaderJoined = "Onceflow-Joined"
	// HeaderRestarted is set on a streamed answer of an attempt that took a call over
	// from an attempt that died mid-stream: its value is the number of bytes the dead
	// attempt had streamed, which this answer does not continue: it is a whole new
	// stream, from its first event.
	HeaderRestarted = "Onceflow-Stream-Restarted"
)

// flightEnd is how a flight ended.
type flightEnd int

const (
	flightRunning  flightEnd = iota
	flightRecorded           // rec holds the answer every request for the key gets
	flightAnswered           // answer holds an upstream error answer, not recorded
	flightCut                // no answer: the attempt failed or its stream was cut
	flightEnded              // a stream that ended as the upstream ended it, not recorded (an error event)

	// flightComplete is what passOn returns once the owner's client has every byte of
	// a complete stream, which is being recorded: not an end of the flight.
	flightComplete
)

// answer is an unrecorded HTTP answer.
type answer struct {
	status int
	header http.Header
	body   []byte
}

// flight is a keyed call this process is making, which requests for the same key on
// this process follow in memory. The owner calls start (streams), write and finish;
// followers read under mu and wait on changed, which is closed at every change.
type flight struct {
	attempt int
	hash    string          // the request's fingerprint
	permit  *limiter.Permit // the limiter's admission of the call, nil without a limiter

	mu      sync.Mutex
	changed chan struct{}
	started bool // a stream began: status and header are set
	status  int
	header  http.Header
	body    []byte // a stream's bytes so far, as sent to the owner's client
	// complete is set once a stream's bytes are all in and make a complete answer,
	// before it is recorded: the owner's client needs no more than that (whatever the
	// recording does, these bytes are what it was given), and gets the end of its
	// response without waiting for the commit.
	complete bool
	end      flightEnd
	rec      *ledger.Record
	answer   *answer
}

func newFlight(attempt int, hash string) *flight {
	return &flight{attempt: attempt, hash: hash, changed: make(chan struct{})}
}

// notify wakes the followers; f.mu is held.
func (f *flight) notify() {
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *flight) start(status int, h http.Header) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.started, f.status, f.header = true, status, h
	f.notify()
}

func (f *flight) write(p []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.body = append(f.body, p...)
	f.notify()
}

// bytes returns the stream's bytes so far. The slice is never written again (body only
// grows), so it may be read without the lock.
func (f *flight) bytes() []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.body
}

// markComplete notes that the stream's bytes are all in, complete (flight.complete).
func (f *flight) markComplete() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.complete = true
	f.notify()
}

// finish ends the flight once; later calls change nothing.
func (f *flight) finish(end flightEnd, rec *ledger.Record, a *answer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.end != flightRunning {
		return
	}
	f.end, f.rec, f.answer = end, rec, a
	f.notify()
}

// flights are the calls this process makes, by ledger key, and those that ended with
// an upstream error answer in the last recentAnswerTTL: a request that joined such a
// call may look for it only after it ended (it saw the row in flight before the owner
// put its flight here, or polled the ledger meanwhile), and must still get its answer
// rather than make the call again.
type flights struct {
	mu     sync.Mutex
	m      map[string]*flight
	recent map[string]endedFlight
	pruned time.Time
}

// endedFlight is a flight that ended with an error answer, and when.
type endedFlight struct {
	f  *flight
	at time.Time
}

// recentAnswerTTL is how long an error answer stays for the joiners of its call.
const recentAnswerTTL = 5 * time.Second

func (fs *flights) add(key string, f *flight) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.m == nil {
		fs.m = map[string]*flight{}
	}
	fs.m[key] = f
}

// remove forgets f (and only f: a later attempt may have replaced it); a flight that
// ended with an error answer is kept among the recent ones.
func (fs *flights) remove(key string, f *flight) {
	f.mu.Lock()
	answered := f.end == flightAnswered
	f.mu.Unlock()
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.m[key] == f {
		delete(fs.m, key)
	}
	now := time.Now()
	if now.Sub(fs.pruned) > time.Second {
		fs.pruned = now
		maps.DeleteFunc(fs.recent, func(_ string, e endedFlight) bool { return now.Sub(e.at) > recentAnswerTTL })
	}
	if answered {
		if fs.recent == nil {
			fs.recent = map[string]endedFlight{}
		}
		fs.recent[key] = endedFlight{f, now}
	}
}

// recentAnswer returns the flight of key and hash that ended with an error answer in
// the last recentAnswerTTL, or nil.
func (fs *flights) recentAnswer(key, hash string) *flight {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	e, ok := fs.recent[key]
	if !ok || e.f.hash != hash || time.Since(e.at) > recentAnswerTTL {
		return nil
	}
	return e.f
}

func (fs *flights) get(key string) *flight {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.m[key]
}

// joinOutcome is what a join leaves to its caller.
type joinOutcome int

const (
	joinServed  joinOutcome = iota // the request was answered (or its client left)
	joinBegin                      // nobody owns the call any more: Begin again
	joinTimeout                    // nothing began within the join timeout: answer 409
)

// joiner is the state of one request following a call: what it sent its client, as a
// count and a digest (not a copy: many joiners of a long stream would each hold one).
type joiner struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	attempt int       // the attempt whose stream it passes on; 0 before the headers
	sent    int       // the body bytes sent so far
	digest  hash.Hash // SHA-256 of them
}

func (j *joiner) headerSent() bool { return j.attempt != 0 }

// startStream sends the headers of a stream followed from attempt.
func (j *joiner) startStream(attempt, status int, h http.Header) {
	for k, vs := range h {
		if recordedHeader(k) {
			j.w.Header()[k] = vs
		}
	}
	j.w.Header().Set(idempotency.HeaderReplayed, "true")
	j.w.Header().Set(HeaderJoined, "true")
	if status == 0 {
		status = http.StatusOK
	}
	j.w.WriteHeader(status)
	j.attempt = attempt
	_ = j.rc.Flush()
}

// send passes on stream bytes; false when the client is gone.
func (j *joiner) send(p []byte) bool {
	if len(p) == 0 {
		return true
	}
	j.sent += len(p)
	j.digest.Write(p)
	if _, err := j.w.Write(p); err != nil {
		return false
	}
	return j.rc.Flush() == nil
}

// finishStream sends what the recorded answer holds beyond the bytes sent, or cuts the
// connection when the record does not continue them (another attempt's answer won).
func (j *joiner) finishStream(rec *ledger.Record) {
	if len(rec.Raw) < j.sent {
		panic(http.ErrAbortHandler)
	}
	if sum := sha256.Sum256(rec.Raw[:j.sent]); !bytes.Equal(sum[:], j.digest.Sum(nil)) {
		panic(http.ErrAbortHandler)
	}
	j.send(rec.Raw[j.sent:])
}

// replayJoined answers with a recorded answer, marked as joined.
func replayJoined(w http.ResponseWriter, rec *ledger.Record) {
	w.Header().Set(HeaderJoined, "true")
	replay(w, rec)
}

// join follows the call key (hash: the request's fingerprint) that another request
// owns, until it can answer, the call is free to claim (joinBegin), or nothing began
// within the join timeout (joinTimeout). ctx is the request's own context: a joiner
// whose client leaves stops following; the call goes on.
func (g *Gateway) join(ctx context.Context, w http.ResponseWriter, key, hash string) joinOutcome {
	g.joining.Inc()
	defer g.joining.Dec()
	j := &joiner{w: w, rc: http.NewResponseController(w), digest: sha256.New()}
	joinBy := time.Now().Add(g.cfg.JoinTimeout)
	// Once a stream is being passed on, the join timeout no longer applies (the answer
	// began); the owner's own timeout bounds it, and this bounds a follower of an
	// owner on another process that went silent without losing its lease.
	followBy := joinBy.Add(g.cfg.Timeout)
	ctx, cancel := context.WithDeadline(ctx, followBy)
	defer cancel()
	defer context.AfterFunc(g.base, cancel)()
	timer := time.NewTimer(time.Until(joinBy))
	defer timer.Stop()
	poll := joinPollMin
	outage := false
	for {
		if f := g.flights.get(key); f != nil && f.hash == hash && (!j.headerSent() || j.attempt == f.attempt) {
			return g.follow(ctx, j, f, timer.C)
		}
		p, err := g.ledger.Progress(ctx, key, j.sent)
		var recent *flight
		if err == nil && p != nil && !p.Live && p.State == ledger.StateFailed {
			// A clean failure numbers the row's next attempt: the answered flight is
			// the attempt before it, never an older one.
			if f := g.flights.recentAnswer(key, hash); f != nil && f.attempt+1 == p.Attempt {
				recent = f
			}
		}
		switch {
		case err != nil && ctx.Err() != nil:
			return g.leave(j)
		case err != nil && j.headerSent():
			// A stream being passed on rides out a PostgreSQL outage: its owner goes on,
			// and the rest is read once the database is back (by the follow bound).
			if !outage {
				outage = true
				g.log.WarnContext(ctx, "gateway: ledger unavailable while passing a joined stream on; polling on", "err", err)
			}
		case err != nil:
			g.ledgerUnavailable(ctx, w, "gateway: ledger unavailable while joining a call", err)
			return joinServed
		case p == nil || p.RequestHash != hash: // purged (or reused: Begin says so)
			return g.again(j)
		case p.Record != nil:
			g.requests.WithLabelValues(resultJoined).Inc()
			if j.headerSent() {
				j.finishStream(p.Record)
			} else {
				replayJoined(w, p.Record)
			}
			return joinServed
		case recent != nil && !j.headerSent():
			// The call this request joined failed with an answer on this process before
			// the request could follow it: that answer is its answer too.
			return g.follow(ctx, j, recent, timer.C)
		case !p.Live || (j.headerSent() && p.Attempt != j.attempt):
			return g.again(j) // the attempt followed failed, died or was replaced
		case p.Streaming:
			if !j.headerSent() {
				var m meta
				_ = json.Unmarshal(p.Meta, &m)
				j.startStream(p.Attempt, m.Status, m.Header)
			}
			if len(p.Partial) > 0 {
				if !j.send(p.Partial) {
					return joinServed // the client left
				}
				poll = joinPollMin
			}
		}
		select {
		case <-ctx.Done():
			return g.leave(j)
		case <-timer.C:
			if !j.headerSent() {
				return joinTimeout
			}
		case <-time.After(poll):
		}
		poll = min(poll*3/2, joinPollMax)
	}
}

// again is the outcome when the followed attempt ended without an answer: a joiner
// that sent nothing yet begins again (and may make the call itself); one that passed
// part of a stream on must cut it, so its client sees the stream was not complete.
func (g *Gateway) again(j *joiner) joinOutcome {
	if j.headerSent() {
		panic(http.ErrAbortHandler)
	}
	return joinBegin
}

// leave ends a join whose context ended: the client left, the follow bound passed, or
// the gateway is closing.
func (g *Gateway) leave(j *joiner) joinOutcome {
	if j.headerSent() {
		panic(http.ErrAbortHandler)
	}
	retryAfter(j.w, g.cfg.RetryAfter)
	writeError(j.w, http.StatusServiceUnavailable, "server_error", "gateway_closing", "the gateway stopped waiting for this call; retry with the same key")
	return joinServed
}

// follow passes on a flight of this process.
func (g *Gateway) follow(ctx context.Context, j *joiner, f *flight, joinBy <-chan time.Time) joinOutcome {
	for {
		f.mu.Lock()
		started, status, header := f.started, f.status, f.header
		body := f.body[min(j.sent, len(f.body)):]
		end, rec, ans, changed := f.end, f.rec, f.answer, f.changed
		f.mu.Unlock()
		if started && !j.headerSent() {
			j.startStream(f.attempt, status, header)
		}
		if j.headerSent() && !j.send(body) {
			return joinServed
		}
		switch end {
		case flightRecorded:
			g.requests.WithLabelValues(resultJoined).Inc()
			if j.headerSent() {
				j.finishStream(rec)
			} else {
				replayJoined(j.w, rec)
			}
			return joinServed
		case flightAnswered:
			if j.headerSent() {
				panic(http.ErrAbortHandler)
			}
			g.requests.WithLabelValues(resultJoined).Inc()
			j.w.Header().Set(HeaderJoined, "true")
			ans.write(j.w)
			return joinServed
		case flightCut:
			return g.again(j)
		case flightEnded:
			if !j.headerSent() {
				return g.again(j)
			}
			g.requests.WithLabelValues(resultJoined).Inc()
			return joinServed // every byte was passed on above
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return g.leave(j)
		case <-joinBy:
			if !j.headerSent() {
				return joinTimeout
			}
		}
	}
}
