package ledger

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Held is the answers of calls made through a Client under HoldAnswers: received from
// the provider and returned to the caller, not yet recorded. Each stays unrecorded
// until the caller records it, in a transaction of its own (Queue, then Committed:
// one commit for the answer and what the caller writes with it) or alone
// (Ledger.RecordHeld). Until then a crash of the caller leaves the call's row in_flight, as a crash during
// the call would: the next attempt takes it over once the lease ends, counted as
// ambiguous, and asks again. Its zero value is ready to use; it is safe for concurrent
// use.
type Held struct {
	// recording is held by RecordHeld for its whole run: one at a time, and a second
	// one learns how the first ended (err).
	recording sync.Mutex
	mu        sync.Mutex
	running   int // RecordHeld calls started and not ended
	items     []heldAnswer
	queued    int // items[:queued] went into a batch whose commit is not known yet
	// err is the first *SupersededError or ErrKeyReused RecordHeld met: the caller
	// acted on an answer that is not the recorded one, and Queue and RecordHeld go on
	// returning it, so that nothing written with h commits after it.
	err error
}

// heldAnswer is one answer held: the attempt that owns the row and its result.
type heldAnswer struct {
	att *Attempt
	res Result
}

// heldKey is the context key of a *Held.
type heldKey struct{}

// HoldAnswers returns ctx under which Client.Complete and Client.Stream return a new
// answer without recording it: the answer is held in h for the caller to record with
// its own writes (onceflow's job runtime: the job's Commit right after its last model
// step, so that the answer, the job's rows and its effects are one commit).
// Attempt.Succeed records as without it. The caller must record every held answer
// (Queue, or Ledger.RecordHeld) before it acts on one outside that transaction.
func HoldAnswers(ctx context.Context, h *Held) context.Context {
	return context.WithValue(ctx, heldKey{}, h)
}

// heldFrom returns ctx's Held, or nil.
func heldFrom(ctx context.Context) *Held {
	h, _ := ctx.Value(heldKey{}).(*Held)
	return h
}

// hold keeps att's answer res unrecorded in h, ending the attempt's lease renewal:
// the row keeps the lease of its last renewal.
func (h *Held) hold(att *Attempt, res Result) {
	att.end()
	h.mu.Lock()
	h.items = append(h.items, heldAnswer{att: att, res: res})
	h.mu.Unlock()
}

// Pending reports whether h holds an answer not yet recorded, or a RecordHeld is
// recording one.
func (h *Held) Pending() bool {
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.items) > 0 || h.running > 0
}

// Err returns the *SupersededError or ErrKeyReused a RecordHeld of h met, or nil:
// whatever the caller writes with h must fail with it.
func (h *Held) Err() error {
	if h == nil {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// heldSQL records a held answer inside the caller's batch: succeedSQL, made to fail the
// transaction with division_by_zero (IsSuperseded) when it records nothing because
// another attempt's answer was recorded first (or the key holds another request), so
// that nothing the caller wrote with this answer commits.
var heldSQL = `WITH s AS (` + fmt.Sprintf(succeedSQL, "") + `) SELECT 1 / count(*) FROM s`

// supersededCode is the SQLSTATE heldSQL fails with when it records nothing.
const supersededCode = "22012" // division_by_zero

// Queue queues on b, in the order they were held, one statement per held answer that
// records it, and returns their keys in that order. A statement that cannot record its
// answer, since another attempt's was recorded first (or RecordHeld recorded it since
// Queue), fails the batch's transaction (IsSuperseded): RecordHeld then tells which.
// Call Committed once the batch committed; until then, or when it did not, the answers
// stay held (RecordHeld records them, or finds another answer recorded). Queue waits
// for a RecordHeld in progress. Once RecordHeld found an answer superseded (or its key
// reused), Queue queues nothing and returns that error (Err).
func (h *Held) Queue(b *pgx.Batch) ([]string, error) {
	if h == nil {
		return nil, nil
	}
	h.recording.Lock() // a RecordHeld in progress took answers out of items: wait for how it ends
	defer h.recording.Unlock()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err != nil {
		return nil, h.err
	}
	keys := make([]string, len(h.items))
	for i, it := range h.items {
		b.Queue(heldSQL, it.att.succeedArgs(it.res)...)
		keys[i] = it.att.Key()
	}
	h.queued = len(h.items)
	return keys, nil
}

// Committed tells h that the batch of its last Queue committed: its answers are
// recorded.
func (h *Held) Committed() {
	if h == nil {
		return
	}
	h.mu.Lock()
	n := min(h.queued, len(h.items))
	done := h.items[:n]
	h.items = append([]heldAnswer(nil), h.items[n:]...)
	h.queued = 0
	h.mu.Unlock()
	for _, it := range done {
		it.att.l.metrics.attempt(it.att.call, resultSucceeded)
	}
}

// IsSuperseded reports whether err, from a statement Queue queued, says that another
// attempt's answer was recorded first: the caller's transaction did not commit, and a
// repeat of the call replays the recorded answer.
func IsSuperseded(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == supersededCode
}

// RecordHeld records h's held answers each in a write of its own, as Attempt.Succeed
// does (under ctx's DeferFlush without waiting for its flush; otherwise durably), and
// empties h. An answer already recorded as this
// attempt's (a batch of Queue's that committed although its caller did not learn so)
// counts as recorded. It returns a *SupersededError when another attempt's answer was
// recorded first (the caller acted on an answer that is not the recorded one: retry, to
// replay it), ErrKeyReused, or a database error (ErrUnavailable: those answers stay
// held, for a later Queue or RecordHeld). The first two stay h's: every later
// RecordHeld and Queue returns it. A RecordHeld waits for one in progress.
func (l *Ledger) RecordHeld(ctx context.Context, h *Held) error {
	_, err := l.recordHeld(ctx, h)
	return err
}

// RecordHeldDurably records h's held answers as RecordHeld does, each durably whatever
// ctx says, and makes the answers recorded under d without waiting for their flush
// durable too: the durable write of an answer it records covers those recorded before
// it; when it records none (none was held, or a RecordHeld in progress, which it waited
// for, recorded them, perhaps without a flush), or one was recorded under d meanwhile,
// one Flush of d does, also when an answer of h was found superseded or its key reused
// (the answers recorded under d are the caller's all the same). It is what a caller
// runs before acting on its answers outside its own transactions, and at its end
// (onceflow's job runtime). Errors as RecordHeld's (first), then Flush's.
func (l *Ledger) RecordHeldDurably(ctx context.Context, h *Held, d *Deferred) error {
	before := d.Mark()
	wrote, err := l.recordHeld(DeferFlush(ctx, nil), h)
	if errors.Is(err, ErrUnavailable) {
		return err // PostgreSQL could not record: it cannot flush either
	}
	if wrote > 0 {
		d.FlushedSince(before)
	}
	switch ferr := l.Flush(ctx, d); {
	case err == nil:
		return ferr
	case ferr != nil: // the caller hears of the held answer; the flush's failure is logged
		l.log.WarnContext(ctx, "ledger: could not flush the answers recorded beside one superseded or of a reused key", "err", ferr)
	}
	return err
}

// recordHeld is RecordHeld, and also returns how many answers it wrote (not counting
// one found already recorded as this attempt's).
func (l *Ledger) recordHeld(ctx context.Context, h *Held) (wrote int, err error) {
	if h == nil {
		return 0, nil
	}
	h.mu.Lock()
	h.running++
	h.mu.Unlock()
	h.recording.Lock()
	defer h.recording.Unlock()
	h.mu.Lock()
	items := h.items
	h.items, h.queued = nil, 0
	h.mu.Unlock()
	var first error
	var failed []heldAnswer
	for _, it := range items {
		switch ours, err := it.att.record(ctx, it.res); {
		case err == nil:
			if ours {
				wrote++
			}
		case errors.Is(err, ErrUnavailable):
			failed = append(failed, it)
			if first == nil {
				first = err
			}
		case first == nil || errors.Is(first, ErrUnavailable):
			// A superseded answer or a reused key says more than a database error: the
			// caller must not go on with the answer it holds.
			first = err
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.running--
	h.items = append(failed, h.items...)
	switch {
	case h.err != nil:
		return wrote, h.err
	case first != nil && !errors.Is(first, ErrUnavailable):
		h.err = first
	}
	return wrote, first
}

// record is Succeed for a held answer: its own recorded earlier counts as recorded.
// ours reports whether this call wrote it.
func (a *Attempt) record(ctx context.Context, res Result) (ours bool, err error) {
	rec, ours, err := a.Succeed(ctx, res)
	switch {
	case err != nil:
		return false, err
	case ours:
		return true, nil
	case a.sameAnswer(rec, res):
		a.l.metrics.attempt(a.call, resultSucceeded)
		return false, nil
	}
	return false, &SupersededError{Key: a.call.Key}
}
