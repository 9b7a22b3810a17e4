package onceflow

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"strings"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/breaker"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/limiter/pgbudget"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/llmmetrics"
	"github.com/onceflow/onceflow/llm/toolkey"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// DefaultProvider names the model's provider in ledger rows and metrics when
// Config.Provider is empty.
const DefaultProvider = "llm"

// model is the model machinery of a Client with Config.Model.
type model struct {
	client   llm.Client // Config.Model through the ledger, behind the limiter and the breaker
	ledger   *ledger.Ledger
	limiter  *limiter.Limiter // nil with Config.NoLimits
	breaker  *breaker.Breaker
	provider string
	policy   retry.Policy
}

// setupModel prepares the model calls of Config.Model: the ledger, the breaker that
// gates the queues while the provider is down (an exhausted quota, a run of failures),
// and the ledger's purge in Run.
func (c *Client) setupModel() error {
	cfg := c.cfg
	if cfg.Model == nil {
		return nil
	}
	if cfg.DB == nil {
		return errors.New("onceflow: Config.DB is required with Config.Model: the llm_calls ledger of model calls is in PostgreSQL")
	}
	if err := checkPolicy(cfg.ModelRetry); err != nil {
		return err
	}
	policy := cfg.ModelRetry.WithDefaults()
	if policy.MinAttempt > cfg.JobBudget {
		return fmt.Errorf("onceflow: Config.JobBudget %v is shorter than Config.ModelRetry.MinAttempt %v: no model call could ever start", cfg.JobBudget, policy.MinAttempt)
	}
	lc := cfg.Ledger
	if lc.Logger == nil {
		lc.Logger = c.log
	}
	if lc.Registerer == nil {
		lc.Registerer = cfg.Registerer
	}
	// A row must outlive every redelivery of its job, or a late delivery calls again.
	retention := cmp.Or(lc.Retention, ledger.DefaultRetention)
	for _, name := range c.queueNames() {
		qc := c.queues[name]
		deliveries := cmp.Or(qc.MaxDeliveries, queue.DefaultMaxDeliveries)
		wait := max(cmp.Or(qc.ClaimIdle, queue.DefaultClaimIdle), cmp.Or(qc.RetryMax, queue.DefaultRetryMax))
		if horizon := time.Duration(deliveries) * (wait + cfg.JobBudget); retention < horizon {
			return fmt.Errorf("onceflow: Config.Ledger.Retention %v must cover queue %q's retry horizon, MaxDeliveries × (max(ClaimIdle, RetryMax) + JobBudget) = %v", retention, name, horizon)
		}
	}
	l, err := ledger.New(cfg.DB, lc)
	if err != nil {
		return fmt.Errorf("onceflow: Config.Ledger: %w", err)
	}
	b, err := breaker.New(breaker.Config{Name: "llm", ProbeInterval: cfg.QuotaProbe, RunProbeInterval: cmp.Or(cfg.ModelFailureProbe, DefaultModelFailureProbe), Threshold: cfg.BreakerThreshold,
		Logger: c.log, Registerer: cfg.Registerer})
	if err != nil {
		return fmt.Errorf("onceflow: Config.QuotaProbe or BreakerThreshold: %w", err)
	}
	provider := cmp.Or(cfg.Provider, DefaultProvider)
	// llmmetrics is inside the ledger (it counts the calls that reach the provider, not
	// the answers the ledger replays) and counts the policy's retries beside the user's
	// OnRetry. The breaker is outside the ledger: a call it stops writes no row.
	m := llmmetrics.New(cfg.Registerer)
	if onRetry := policy.OnRetry; onRetry != nil {
		policy.OnRetry = func(r retry.Retry) { m.OnRetry(r); onRetry(r) }
	} else {
		policy.OnRetry = m.OnRetry
	}
	// The limiter admits a call before the ledger (a call the ledger replays, or waits
	// for, gives its capacity back uncharged) and observes it below the ledger.
	var calls llm.Client
	var lim *limiter.Limiter
	provided := m.Instrument(provider, cfg.Model)
	if cfg.NoLimits {
		calls = l.Wrap(provider, provided)
	} else {
		if lim, err = c.newLimiter(provider); err != nil {
			return err
		}
		calls = lim.WrapAround(func(next llm.Client) llm.Client { return l.Wrap(provider, next) }, provided)
		c.background = append(c.background, lim.Run)
	}
	c.model = &model{client: llm.WithBreaker(calls, b), ledger: l, limiter: lim, breaker: b, provider: provider, policy: policy}
	c.background = append(c.background, l.Run)
	return nil
}

// newLimiter is Config.Limits with the client's defaults: its prefix, provider, logger,
// registerer, quota pause (QuotaProbe) and, with Config.DB, the tenant_budgets table.
func (c *Client) newLimiter(provider string) (*limiter.Limiter, error) {
	lc := c.cfg.Limits
	lc.Prefix = cmp.Or(lc.Prefix, c.cfg.Prefix)
	lc.Provider = cmp.Or(lc.Provider, provider)
	if lc.Logger == nil {
		lc.Logger = c.log
	}
	if lc.Registerer == nil {
		lc.Registerer = c.cfg.Registerer
	}
	if lc.Budgets == nil && c.cfg.DB != nil {
		lc.Budgets = pgbudget.New(c.cfg.DB)
	}
	// An exhausted quota stops the model's breaker, which probes every QuotaProbe: the
	// limiter pauses the fleet as long, so that its pause never holds back the probe.
	lc.QuotaPause = cmp.Or(lc.QuotaPause, c.cfg.QuotaProbe)
	lim, err := limiter.New(c.rdb, lc)
	if err != nil {
		return nil, fmt.Errorf("onceflow: Config.Limits: %w", err)
	}
	return lim, nil
}

// checkPolicy refuses negative settings of Config.ModelRetry, naming the field.
func checkPolicy(p retry.Policy) error {
	for name, d := range map[string]time.Duration{"Base": p.Base, "Cap": p.Cap, "PerCallTimeout": p.PerCallTimeout,
		"MinAttempt": p.MinAttempt, "RetryAfterCap": p.RetryAfterCap} {
		if d < 0 {
			return fmt.Errorf("onceflow: Config.ModelRetry.%s %v must not be negative", name, d)
		}
	}
	if p.MaxAttempts < 0 {
		return fmt.Errorf("onceflow: Config.ModelRetry.MaxAttempts %d must not be negative", p.MaxAttempts)
	}
	return nil
}

// Step is the answer to one model call of a job, named by the job and a step name: see
// Job.Complete and Job.Stream.
type Step struct {
	// Name is the step's name, as given to Complete or Stream.
	Name string
	// Key is the ledger key of the call, ledger.Key(ledger.Work(job ID, Name), request):
	// the same for every delivery of the job that makes the same request, never derived
	// from the attempt. It is sent to the provider as Idempotency-Key, and it is the
	// request key that tool-call keys derive from (ToolKey).
	Key string
	// Response is the model's answer: the one recorded in the ledger, so every delivery
	// that gets this step's answer gets the same one.
	Response *llm.Response

	toolKeys []ledger.ToolKey
}

// ToolKey returns the idempotency key to send downstream with the effect of call, one
// of Response.ToolCalls (a refund's Idempotency-Key, an outbox dedupe key): the same for
// every delivery and every retried request of the job's step, so the system the tool
// writes to can refuse the duplicate.
//
// Providers' tool-call ids are mostly unstable: the same call comes back with a new id
// when the request is made again. ToolKey does not guess. When the answer arrived,
// Complete and Stream recorded its calls in the ledger (ledger.ToolKeys: the first id
// seen for each call, identified by the request key, the tool name and the canonical
// arguments), and ToolKey is toolkey.IDKey(Key, that first id). So a repeated request
// that produces the same call (same tool, same arguments) under another id gets the key
// of the first sight (the change is logged and counted as an unstable id); two identical
// calls in one answer stay two effects; and a provider whose ids are stable keeps its
// keys. A call without an id, or one not in Response, gets toolkey.ArgsKey(Key, call).
// ToolKey is safe for concurrent use.
func (s *Step) ToolKey(call llm.ToolCall) string {
	for _, tk := range s.toolKeys {
		if tk.Call == call {
			return tk.Key
		}
	}
	return toolkey.ArgsKey(s.Key, call)
}

// ToolKeys returns what the ledger recorded of each of Response.ToolCalls, in order:
// the call, its key (ToolKey), the first id seen for it and what this answer proved of
// the provider's ids (toolkey.Unstable when the call came back with another id).
func (s *Step) ToolKeys() []ledger.ToolKey { return append([]ledger.ToolKey(nil), s.toolKeys...) }

// Complete calls the model with req as step step of the job, through the llm_calls
// ledger, under Config.ModelRetry and the delivery's JobBudget, and returns the answer.
//
//   - The call's work is the job and the step (ledger.Work(job.ID, step);
//     req.IdempotencyKey is ignored, and req is not modified): a redelivered job whose
//     answer was recorded gets it back without calling the model; a delivery that meets
//     another's call of the same step in flight waits for it; two steps of one job, or
//     one step with another request (a new prompt after a deploy), are two calls.
//   - Each attempt runs under the policy's per-call timeout, and all of them, with the
//     sleeps between them, within the delivery's deadline: JobBudget from the start of
//     the delivery, shared by every step of it. Retryable failures (429, 5xx, timeouts,
//     resets) are retried with backoff that honours Retry-After.
//   - The answer is recorded with the job's Commit when the Commit follows the step (in
//     its transaction: no write of its own), and otherwise before anything else the
//     delivery does: the next step, Do, a tool, a wait, an Enqueue, CommitTx, or the
//     end of the delivery (docs/providers.md, "Two commits per model step";
//     Config.DurableAnswers records it before the step returns).
//   - If the answer has tool calls, it is recorded at once, and their keys in the same
//     step (one more round trip): see Step.ToolKey.
//
// The error is made to be returned as is by the Worker: an outage of the provider (an
// exhausted quota, the breaker open because of one or because Config.BreakerThreshold
// calls in a row, this one included, failed with a 5xx, a timeout or a lost connection
// after their retries, or such a failure that continues a run of failing calls)
// matches ErrUnavailable, and the job is handed back without
// spending a delivery while the queues wait for the breaker's probe; so does PostgreSQL unreachable under the ledger (a refused or lost connection,
// a server shutting down: the ledger's calls were retried within the delivery's budget
// first), and the job is handed back to wait for it; a failure no retry can fix (a 400,
// a malformed answer, no Config.Model) matches ErrPermanent and the job is
// dead-lettered; anything else (attempts exhausted, the delivery deadline, a failing
// ledger statement, shutdown) is plain and the job is delivered again. ctx is the Work
// call's.
//
// Options change how the call is made: InBatch sends it through the batch lane (so does
// Config.Batch.Kinds for every call of a job of a listed kind).
func (j *Job[T]) Complete(ctx context.Context, step string, req *llm.Request, opts ...StepOption) (*Step, error) {
	var o stepOptions
	if j.run != nil && j.run.client.batch != nil {
		if within, ok := j.run.client.batch.cfg.Kinds[j.Kind]; ok {
			o.batch, o.within = true, within
		}
	}
	for _, opt := range opts {
		opt(&o)
	}
	if o.batch {
		return j.run.completeInBatch(ctx, j.ID, step, req, o.within)
	}
	return j.run.complete(ctx, j.ID, step, req)
}

// Stream calls the model with req as step step of the job, as Complete does, and
// streams the answer: iterate StepStream.All. The call is made when the iteration
// starts.
//
// Through the ledger, the text is persisted on the call's row as it arrives (in
// batches) and the complete answer is recorded as Complete's is (with the job's
// Commit, or before anything else the delivery does), so effects made through the
// Commit rest only on complete, recorded answers; a redelivered
// job whose answer was recorded gets it replayed (one text chunk and the final chunk)
// without a call. The policy's per-call timeout bounds each whole attempt, first byte
// to final chunk, and the delivery's deadline all of them.
//
// A retryable failure before the first chunk (a 429, a 503, a refused connection) is
// retried under the policy, unseen. Once a chunk was yielded a failure is not retried
// in this delivery: it ends the iteration as its last element, mapped as Complete's
// errors are (a dropped connection is plain, so returning it makes the queue deliver
// the job again), and the next delivery's ledger decides: the dropped attempt is
// recorded as ambiguous, with its partial text kept on the row, and the new delivery
// makes a new generation (streams cannot resume). Stopping the iteration early
// abandons the attempt (recorded as ambiguous too).
func (j *Job[T]) Stream(ctx context.Context, step string, req *llm.Request) *StepStream {
	return j.run.stream(ctx, j.ID, step, req)
}

// StepStream is a streamed model call of a job's step, from Job.Stream. Iterate All
// once, from the goroutine of the Work call (or one it waits for).
type StepStream struct {
	name, key string
	seq       iter.Seq2[llm.Chunk, error]
	used      atomic.Bool
	step      *Step // set at the final chunk
}

// Key returns the ledger key of the call (Step.Key), known before the call is made.
func (s *StepStream) Key() string { return s.key }

// Step returns the step's answer once All has yielded the final chunk (Done): the
// collected Response and its tool keys (Step.ToolKey). Before that, and after a
// failure, it returns nil.
func (s *StepStream) Step() *Step { return s.step }

// All yields the answer's chunks: text deltas, then one final chunk (Done) with the
// finish reason, the tool calls and the usage. A failure ends the sequence as its
// last element (see Job.Stream for which failures are retried first and how errors
// map); a second iteration yields a permanent error.
func (s *StepStream) All() iter.Seq2[llm.Chunk, error] {
	return func(yield func(llm.Chunk, error) bool) {
		if !s.used.CompareAndSwap(false, true) {
			yield(llm.Chunk{}, retry.Permanent(fmt.Errorf("onceflow: model step %q: a StepStream is iterated once", s.name)))
			return
		}
		s.seq(yield)
	}
}

func (rt *runtime) stream(ctx context.Context, jobID, step string, req *llm.Request) *StepStream {
	m, out, key, err := rt.prepare(jobID, step, req)
	s := &StepStream{name: step, key: key}
	if err != nil {
		s.seq = func(yield func(llm.Chunk, error) bool) { yield(llm.Chunk{}, err) }
		return s
	}
	ctx = rt.answerContext(rt.limiterContext(ctx))
	s.seq = func(yield func(llm.Chunk, error) bool) {
		rt.modelCalls.Add(1)
		defer rt.modelCalls.Add(-1)
		if err := rt.releaseHeld(ctx, false); err != nil {
			yield(llm.Chunk{}, err)
			return
		}
		stopped := false
		start := time.Now()
		var last time.Time // when the last attempt started, for callError
		_, err := retry.Do(ctx, m.streamPolicy(), rt.deadline, func(ctx context.Context) (struct{}, error) {
			last = time.Now()
			yielded := false
			var content strings.Builder
			resp := &llm.Response{Model: out.Model}
			for ch, err := range m.client.Stream(rt.holdContext(ctx), out) {
				if err == nil {
					collect(resp, &content, ch)
				}
				if err == nil && ch.Done {
					err = rt.releaseForLater(ctx, resp)
				}
				if err == nil && ch.Done {
					st := &Step{Name: step, Key: key, Response: resp}
					mark := rt.answers.Mark()
					if err = m.recordToolKeys(ctx, st); err == nil {
						rt.toolKeysRecorded(st, mark)
						rt.shadow(ctx, jobID, step, out, st, time.Since(start))
						// A gate that holds the job ends the stream with its error, before
						// the final chunk: the Worker returns it, and the job parks.
						if st, err = rt.gate(ctx, jobID, step, out, st, true); err != nil {
							yield(llm.Chunk{}, err)
							stopped = true
							return struct{}{}, nil
						}
						s.step = st
					}
				}
				if err != nil {
					if yielded { // the consumer saw output of this generation: not here
						return struct{}{}, &midStreamError{err}
					}
					return struct{}{}, err
				}
				yielded = true
				if !yield(ch, nil) {
					stopped = true
					return struct{}{}, nil
				}
			}
			return struct{}{}, nil
		})
		if err != nil && !stopped {
			yield(llm.Chunk{}, m.callError(step, err, last))
			return
		}
		rt.client.postgresWorked() // the ledger wrote the call
	}
	return s
}

// collect adds ch to resp, as llm.Collect does.
func collect(resp *llm.Response, content *strings.Builder, ch llm.Chunk) {
	content.WriteString(ch.Content)
	resp.ID = cmp.Or(ch.ID, resp.ID)
	resp.RequestID = cmp.Or(ch.RequestID, resp.RequestID)
	if ch.Raw != nil {
		resp.Raw = append(append(resp.Raw, ch.Raw...), '\n')
	}
	if ch.Done {
		resp.Content = content.String()
		resp.FinishReason, resp.ToolCalls = ch.FinishReason, ch.ToolCalls
		if ch.Usage != nil {
			resp.Usage = *ch.Usage
		}
	}
}

// midStreamError is a stream's failure after chunks were yielded: retry.Do must not
// retry it (the consumer has seen output of this generation), the queue may.
type midStreamError struct{ err error }

func (e *midStreamError) Error() string {
	return "stream failed after output was yielded: " + e.err.Error()
}
func (e *midStreamError) Unwrap() error { return e.err }

// streamPolicy is the policy with a classifier that does not retry a midStreamError.
func (m *model) streamPolicy() retry.Policy {
	p := m.policy
	classify := p.Classify
	p.Classify = func(err error) retry.Verdict {
		v := classify(err)
		var mid *midStreamError
		if errors.As(err, &mid) {
			v.Retryable = false
		}
		return v
	}
	return p
}

// prepare checks a step's call and returns the model, the request as sent (the step's
// work in IdempotencyKey) and its ledger key.
func (rt *runtime) prepare(jobID, step string, req *llm.Request) (*model, *llm.Request, string, error) {
	if rt == nil || rt.client == nil || rt.client.model == nil {
		return nil, nil, "", retry.Permanent(fmt.Errorf("%w: model step %q", ErrNoModel, step))
	}
	if step == "" {
		return nil, nil, "", retry.Permanent(errors.New("onceflow: model step: the step name is empty"))
	}
	if req == nil {
		return nil, nil, "", retry.Permanent(fmt.Errorf("onceflow: model step %q: nil request", step))
	}
	out := *req
	out.IdempotencyKey = ledger.Work(jobID, step)
	return rt.client.model, &out, ledger.Key(out.IdempotencyKey, &out), nil
}

func (rt *runtime) complete(ctx context.Context, jobID, step string, req *llm.Request) (*Step, error) {
	m, out, key, err := rt.prepare(jobID, step, req)
	if err != nil {
		return nil, err
	}
	ctx = rt.answerContext(rt.limiterContext(ctx))
	rt.modelCalls.Add(1)
	defer rt.modelCalls.Add(-1)
	if err := rt.releaseHeld(ctx, false); err != nil {
		return nil, err
	}
	start := time.Now()
	var last time.Time // when the last attempt started, for callError
	s, err := retry.Do(ctx, m.policy, rt.deadline, func(ctx context.Context) (*Step, error) {
		last = time.Now()
		resp, err := m.client.Complete(rt.holdContext(ctx), out)
		if err != nil {
			return nil, err
		}
		s := &Step{Name: step, Key: key, Response: resp}
		if err := rt.releaseForLater(ctx, resp); err != nil {
			return nil, err
		}
		mark := rt.answers.Mark()
		if err := m.recordToolKeys(ctx, s); err != nil {
			return nil, err
		}
		rt.toolKeysRecorded(s, mark)
		return s, nil
	})
	if err != nil {
		if rt.delivery != nil && rt.delivery.Kind == ShadowKind && providerFailure(err) {
			// A candidate's (or its judge's) failure says nothing of production's model:
			// no breaker counts it, and the shadow job spends a delivery on it.
			return nil, modelError(step, err)
		}
		return nil, m.callError(step, err, last)
	}
	rt.client.postgresWorked() // the ledger wrote the call
	rt.shadow(ctx, jobID, step, out, s, time.Since(start))
	return rt.gate(ctx, jobID, step, out, s, false)
}

// limiterContext returns ctx carrying the job's tenant for the model's limiter (its
// budget, share and cap).
func (rt *runtime) limiterContext(ctx context.Context) context.Context {
	if rt == nil || rt.delivery == nil || rt.delivery.Tenant == "" {
		return ctx
	}
	return limiter.WithTenant(ctx, rt.delivery.Tenant)
}

// answerContext returns ctx under which the ledger records the step's answer without
// waiting for the WAL flush, for the job's Commit (or the end of the delivery) to flush
// it (docs/providers.md, "Two commits per model step"); ctx itself under
// Config.DurableAnswers.
func (rt *runtime) answerContext(ctx context.Context) context.Context {
	if rt == nil || rt.delivery == nil || rt.client.cfg.DurableAnswers {
		return ctx
	}
	return ledger.DeferFlush(ctx, &rt.answers)
}

// holdContext returns ctx under which the ledger holds a step's new answer unrecorded
// for the job's Commit to record in its own transaction (docs/providers.md, "Two
// commits per model step"); ctx itself under Config.DurableAnswers.
func (rt *runtime) holdContext(ctx context.Context) context.Context {
	if rt == nil || rt.delivery == nil || rt.client.cfg.DurableAnswers {
		return ctx
	}
	return ledger.HoldAnswers(ctx, &rt.held)
}

// releaseHeld records the answers the delivery holds, before anything but the job's
// Commit: a later step, a recorded step or tool, a wait, CommitTx (durable false: they
// commit without waiting for the flush, and the next durable commit on PostgreSQL makes
// them durable), or what may carry one out of the delivery (durable true:
// flushBeforeEffect). An answer another attempt recorded first is an error to retry
// (the delivery acted on an answer that is not the recorded one; the repeat replays
// it); one PostgreSQL could not record stays held and the write's error is returned
// (PostgresError): nothing that may carry it goes on.
func (rt *runtime) releaseHeld(ctx context.Context, durable bool) error {
	if rt == nil || rt.client.model == nil {
		return nil
	}
	var err error
	switch l := rt.client.model.ledger; {
	case durable:
		// Durable whatever ctx says (a gate's or shadow's context defers), and so are
		// the answers recorded before, among them those a recording in progress (which
		// it waits for) made without a flush.
		err = l.RecordHeldDurably(ctx, &rt.held, &rt.answers)
	case !rt.held.Pending():
		return heldError(rt.held.Err()) // an answer found superseded stays the delivery's error
	default:
		err = l.RecordHeld(ledger.DeferFlush(ctx, &rt.answers), &rt.held)
	}
	if herr := heldError(err); herr != nil {
		return herr
	}
	if err != nil {
		return PostgresError(fmt.Errorf("onceflow: record the job's model answers: %w", err))
	}
	return nil
}

// releaseForLater records resp's held answer at once when something after the step
// depends on it before the job's Commit: its tool calls (tools and later turns), or
// another model step of the delivery in progress, which may be a concurrent call of
// the same step waiting for it. Recorded before the tool keys, whose durable insert
// then flushes it.
func (rt *runtime) releaseForLater(ctx context.Context, resp *llm.Response) error {
	if len(resp.ToolCalls) == 0 && rt.modelCalls.Load() <= 1 {
		return nil
	}
	return rt.releaseHeld(ctx, false)
}

// heldError returns the error of ledger.RecordHeld the delivery must return: an
// answer superseded (retryable) or a key reused (permanent); nil for a database error
// (the answers stay held) and for none.
func heldError(err error) error {
	var sup *ledger.SupersededError
	switch {
	case errors.As(err, &sup):
		return err
	case errors.Is(err, ledger.ErrKeyReused):
		return retry.Permanent(err)
	}
	return nil
}

// flushAnswers makes the answers this delivery recorded without waiting for the WAL
// flush durable, when no Commit of the delivery did: one durable write, before the
// queue hears how the delivery ended. A failure is logged: the WAL writer flushes them
// within a fraction of a second anyway, and only a crash of PostgreSQL in that time
// loses one (its call is then asked again, counted as ambiguous).
//
// A delivery that learned that another attempt's answer was recorded before one of its
// own (or that a step's key holds another request) ends with that error, which is not
// logged here; the answers it did record are flushed all the same
// (ledger.Ledger.RecordHeldDurably).
func (rt *runtime) flushAnswers(ctx context.Context) {
	if err := rt.flushBeforeEffect(ctx); err != nil && heldError(err) == nil {
		rt.client.log.WarnContext(ctx, "onceflow: could not make the model answers of a delivery durable at its end", "job_id", rt.delivery.JobID, "err", err)
	}
}

// flushBeforeEffect makes the delivery's pending answers durable before an effect that
// may carry one of them leaves onceflow's transactions (Do's fn, Tool's fn): a crash of
// PostgreSQL after the effect must not take the answer back, or the next delivery would
// ask again and act on another answer under the same keys. One durable write when an
// answer is pending, nothing otherwise. Its error is PostgreSQL's (PostgresError).
func (rt *runtime) flushBeforeEffect(ctx context.Context) error {
	if rt == nil || rt.client.model == nil {
		return nil
	}
	if rt.held.Pending() || rt.held.Err() != nil {
		return rt.releaseHeld(ctx, true)
	}
	if !rt.answers.Pending() {
		return nil
	}
	if err := rt.client.model.ledger.Flush(ctx, &rt.answers); err != nil {
		return PostgresError(fmt.Errorf("onceflow: make the job's model answers durable: %w", err))
	}
	return nil
}

// toolKeysRecorded notes that recording s's tool keys (begun when rt.answers.Mark
// returned mark) made the delivery's answers recorded before it durable: a tool call
// seen for the first time (an id, and nothing known yet of its stability) was inserted,
// and that insert's commit waited for its flush, which covers the answer committed
// before it. Then Do and Tool need no flush of their own.
func (rt *runtime) toolKeysRecorded(s *Step, mark uint64) {
	for _, tk := range s.toolKeys {
		if tk.Call.ID != "" && tk.Stability == toolkey.Unknown {
			rt.answers.FlushedSince(mark)
			return
		}
	}
}

// recordToolKeys records the tool calls of s's answer in the ledger and keeps their
// keys (one round trip; none without tool calls).
func (m *model) recordToolKeys(ctx context.Context, s *Step) error {
	if len(s.Response.ToolCalls) == 0 {
		return nil
	}
	tks, err := m.ledger.ToolKeys(ctx, m.provider, s.Key, s.Response.ToolCalls)
	if err != nil {
		return err
	}
	s.toolKeys = tks
	return nil
}

// modelError maps a model step's failure onto the job's error vocabulary: an outage of
// the provider, or of PostgreSQL under the ledger (a ledger.ErrUnavailable error that
// postgresUnreachable says is PostgreSQL down, not a failing statement), is
// Unavailable; a transient failure plain; anything else Permanent. Only the ledger's
// errors are asked about PostgreSQL: a refused connection to the provider is the
// provider's, transient.
func modelError(step string, err error) error {
	wrapped := fmt.Errorf("onceflow: model step %q: %w", step, err)
	switch {
	case retry.Outage(err), errors.Is(err, ledger.ErrUnavailable) && postgresUnreachable(err):
		return retry.Unavailable(wrapped)
	case retry.Transient(err):
		return wrapped
	}
	return retry.Permanent(wrapped)
}
