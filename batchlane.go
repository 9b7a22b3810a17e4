package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// BatchAPI is a provider's batch endpoint as the batch lane uses it (openai.Batches,
// anthropic.Batches).
type BatchAPI interface {
	// Submit creates a batch of s's items (all of s.Model), naming it s.ID in its
	// metadata where the provider keeps metadata.
	Submit(ctx context.Context, s llm.BatchSubmission) (llm.BatchInfo, error)
	// List returns the batches created since then, as far as the provider lists them.
	List(ctx context.Context, since time.Time) ([]llm.BatchInfo, error)
	// Get says how a batch stands.
	Get(ctx context.Context, id string) (llm.BatchInfo, error)
	// Results yields the outcome of each item of an ended batch, in any order.
	Results(ctx context.Context, id string) iter.Seq2[llm.BatchResult, error]
	// Cancel asks the provider to end a batch early: its items not answered by then
	// end cancelled.
	Cancel(ctx context.Context, id string) error
}

// BatchConfig configures the batch lane (Config.Batch): the model steps that take it
// (InBatch) are collected and sent through the provider's batch API, at its batch price,
// exactly once. See docs/batch.md.
type BatchConfig struct {
	// API is the provider's batch endpoint. Without it, steps that ask for the batch lane
	// take the synchronous one.
	API BatchAPI
	// MaxItems is the most requests per batch. Default: 1000; at most 50,000 (OpenAI's
	// limit; Anthropic's is 100,000).
	MaxItems int
	// MaxAge sends a model's waiting requests as a batch once the oldest has waited this
	// long, however few. Default: 1m.
	MaxAge time.Duration
	// PollInterval is how often the submitter looks for requests to send and for ended
	// batches. Default: 5s.
	PollInterval time.Duration
	// MaxBytes bounds one batch's requests, as the JSON the lane stores them in (about
	// the size of the provider's input file). Default: 100 MB (OpenAI takes files of
	// 200 MB, Anthropic batches of 256 MB).
	MaxBytes int64
	// EnqueuedTokens bounds, per model, the input tokens (estimated as the limiter
	// does, llm.EstimateInputTokens) of the batches sent and not yet ended: the
	// provider's queue limit (OpenAI's enqueued tokens per model). A model's requests
	// wait while a batch of them would pass it; a request larger than the limit alone is
	// sent in a batch of its own once the model has nothing else in the queue. The key
	// "*" applies to models not listed. Default: none. Batch traffic never counts
	// against the synchronous lane's limits (the limiter's RPM and TPM).
	EnqueuedTokens map[string]int64
	// SubmitTimeout bounds one submission's upload and creation at the provider. A
	// submission whose batch id is not recorded (its process died, or the provider
	// failed it) is settled, found at the provider or sent again, only once twice this
	// has passed since it was recorded, so that no process sends it while another may
	// still be doing so (one that lost the lane's lock with its PostgreSQL session).
	// Default: 2m.
	SubmitTimeout time.Duration
	// Kinds sends every Complete of the jobs of these kinds (a workflow's steps)
	// through the lane, as InBatch with the given bound does for one call; an InBatch
	// on the call overrides it. Stream never takes the lane.
	Kinds map[string]time.Duration
}

// Batch lane defaults (BatchConfig).
const (
	DefaultBatchMaxItems      = 1000
	DefaultBatchMaxAge        = time.Minute
	DefaultBatchPollInterval  = 5 * time.Second
	DefaultBatchMaxBytes      = 100 << 20
	DefaultBatchSubmitTimeout = 2 * time.Minute
	maxBatchItems             = 50000
)

// batchPrefix names a step's wait for its batch answer: "batch:" and the ledger key.
const batchPrefix = "batch:"

// batchLockKey is the advisory lock that makes one process at a time submit and poll:
// one per schema, as the lane's tables are (the migrations' lock is keyed alike), so
// that deployments sharing a database in schemas of their own do not take turns.
const batchLockKey = `hashtextextended('onceflow.batch:' || coalesce(current_schema(), ''), 0)`

// StepOption changes how Job.Complete makes a model step.
type StepOption func(*stepOptions)

type stepOptions struct {
	batch  bool
	within time.Duration
}

// InBatch sends the step through the batch lane (Config.Batch): the request waits, with
// others, to be sent in a batch at the provider's batch price, and the job parks,
// holding no worker, until its answer is recorded in the ledger; Complete then returns
// it as any recorded answer. within bounds the wait from the step's first delivery: a
// request whose batch has not answered by then, or whose batch item failed or expired,
// is made in the synchronous lane instead (so give it the step's deadline less the
// time a call takes). Without Config.Batch.API the step takes the synchronous lane.
func InBatch(within time.Duration) StepOption {
	return func(o *stepOptions) { o.batch, o.within = true, within }
}

// batchLane is the Client's batch lane.
type batchLane struct {
	c   *Client
	cfg BatchConfig
	db  *pgxpool.Pool
	log *slog.Logger
	// retention is how long ended requests are kept (the ledger's), keepRequests
	// whether their bodies go to the ledger's rows (ledger.Config.KeepRequests).
	retention    time.Duration
	keepRequests bool
	purged       time.Time // the last purge of ended rows
}

// setupBatch checks Config.Batch.
func setupBatch(cfg *Config) (*batchLane, error) {
	b := cfg.Batch
	if b.API == nil {
		return nil, nil
	}
	switch {
	case cfg.DB == nil || cfg.Model == nil:
		return nil, errors.New("onceflow: Config.Batch needs Config.DB and Config.Model (its answers are recorded in the ledger)")
	case b.MaxItems < 0 || b.MaxItems > maxBatchItems:
		return nil, fmt.Errorf("onceflow: Config.Batch.MaxItems %d is not between 0 and %d", b.MaxItems, maxBatchItems)
	case b.MaxAge < 0 || b.PollInterval < 0 || b.MaxBytes < 0 || b.SubmitTimeout < 0:
		return nil, errors.New("onceflow: Config.Batch: MaxAge, PollInterval, MaxBytes and SubmitTimeout must not be negative")
	}
	for model, n := range b.EnqueuedTokens {
		if n <= 0 {
			return nil, fmt.Errorf("onceflow: Config.Batch.EnqueuedTokens[%q] is %d; a limit is a positive number of tokens", model, n)
		}
	}
	for kind, within := range b.Kinds {
		if within <= 0 {
			return nil, fmt.Errorf("onceflow: Config.Batch.Kinds[%q] is %s; the lane needs a positive bound on the wait", kind, within)
		}
	}
	b.MaxItems = cmp.Or(b.MaxItems, DefaultBatchMaxItems)
	b.MaxAge = cmp.Or(b.MaxAge, DefaultBatchMaxAge)
	b.PollInterval = cmp.Or(b.PollInterval, DefaultBatchPollInterval)
	b.MaxBytes = cmp.Or(b.MaxBytes, DefaultBatchMaxBytes)
	b.SubmitTimeout = cmp.Or(b.SubmitTimeout, DefaultBatchSubmitTimeout)
	return &batchLane{cfg: b, db: cfg.DB, log: cfg.Logger, retention: cmp.Or(cfg.Ledger.Retention, ledger.DefaultRetention),
		keepRequests: cfg.Ledger.KeepRequests}, nil
}

// completeInBatch is Complete in the batch lane: the answer recorded (or the batch's
// failure signalled, or the wait timed out) goes on as Complete does, from the ledger
// or in the synchronous lane; otherwise the request is put in the lane, once, and the
// job parks.
func (rt *runtime) completeInBatch(ctx context.Context, jobID, step string, req *llm.Request, within time.Duration) (*Step, error) {
	c := rt.client
	if c.batch == nil || rt.delivery == nil {
		return rt.complete(ctx, jobID, step, req)
	}
	_, out, key, err := rt.prepare(jobID, step, req)
	if err != nil {
		return nil, err
	}
	name := batchPrefix + key
	js, err := rt.steps(ctx)
	if err != nil {
		return nil, err
	}
	if _, waiting := js.lookup(waitPrefix + name); !waiting {
		body, err := json.Marshal(out)
		if err != nil {
			return nil, Permanent(fmt.Errorf("onceflow: batch step %q: encode the request: %w", step, err))
		}
		tag, err := c.batch.db.Exec(ctx, `INSERT INTO batch_items (key, custom_id, work, request_hash, model, request, tenant, job_id, state, tokens, queue)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9, $10) ON CONFLICT (key) DO NOTHING`,
			key, customID(key), out.IdempotencyKey, ledger.RequestHash(out), out.Model, body, rt.delivery.Tenant, jobID,
			int64(llm.EstimateInputTokens(out)), rt.queue)
		if err != nil {
			return nil, fmt.Errorf("onceflow: batch step %q: %w", step, PostgresError(err))
		}
		if tag.RowsAffected() == 0 { // in the lane already: this job's (a redelivery), or another's
			var state, tenant, job, q string
			if err := c.batch.db.QueryRow(ctx, `SELECT state, tenant, job_id, queue FROM batch_items WHERE key = $1`, key).Scan(&state, &tenant, &job, &q); err != nil &&
				!errors.Is(err, pgx.ErrNoRows) {
				return nil, fmt.Errorf("onceflow: batch step %q: %w", step, PostgresError(err))
			}
			if state == "done" || state == "failed" || tenant != rt.delivery.Tenant || job != jobID || q != rt.queue {
				// Answered or failed already (a job run again), or another job's request
				// (no signal of it would wake this one): the ledger's answer, or a call.
				return rt.complete(ctx, jobID, step, req)
			}
		}
	}
	w, err := rt.wait(ctx, name, within, waitRecord{Tool: "batch", Arguments: out.Model})
	if err != nil {
		return nil, err // parked until the poller records the answer and wakes the job
	}
	if w.timedOut { // not sent yet: never send it now; sent: its answer, if it comes, loses to ours
		if _, err := c.batch.db.Exec(ctx, `UPDATE batch_items SET state = 'failed', error = 'the step''s wait timed out', request = ''::bytea, updated_at = now()
WHERE key = $1 AND state = 'pending'`, key); err != nil {
			return nil, fmt.Errorf("onceflow: batch step %q: %w", step, PostgresError(err))
		}
	}
	return rt.complete(ctx, jobID, step, req) // the recorded answer, or a synchronous call
}

// customID is the provider's custom_id of the call with ledger key key: its hex digits
// (64 characters, Anthropic's limit).
func customID(key string) string { return strings.TrimPrefix(key, ledger.KeyPrefix) }

// run submits and polls every PollInterval until ctx ends; one process at a time does
// (a PostgreSQL advisory lock), the others stand by.
func (b *batchLane) run(ctx context.Context) error {
	t := time.NewTicker(b.cfg.PollInterval)
	defer t.Stop()
	for {
		if err := b.cycle(ctx); err != nil && ctx.Err() == nil {
			b.log.WarnContext(ctx, "onceflow: batch lane", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// cycle is one round of the lane under its lock: settle submissions a crash left
// unrecorded, send what is due, and record the results of ended batches.
func (b *batchLane) cycle(ctx context.Context) error {
	conn, err := b.db.Acquire(ctx)
	if err != nil {
		return PostgresError(err)
	}
	defer conn.Release()
	var got bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(`+batchLockKey+`)`).Scan(&got); err != nil || !got {
		return PostgresError(err)
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock(`+batchLockKey+`)`); err != nil {
			// The session's end releases the lock: close the connection (a closed one is
			// dropped from the pool).
			if cerr := conn.Conn().Close(context.WithoutCancel(ctx)); cerr != nil {
				b.log.WarnContext(ctx, "onceflow: batch lane: could not release its lock; its connection is dropped", "err", err)
			}
		}
	}()
	// Each part goes on past the failures of one submission or batch (logged), so
	// that one the provider refuses, or whose results cannot be read, holds up no
	// other; they return only what stops them all (PostgreSQL down).
	if err := b.recover(ctx); err != nil {
		return err
	}
	if err := b.submitDue(ctx); err != nil {
		return err
	}
	if err := b.poll(ctx); err != nil {
		return err
	}
	return b.purge(ctx)
}

// purge deletes, at most once a minute, the requests that ended longer than the
// ledger's retention ago, and the ended batches left without requests.
func (b *batchLane) purge(ctx context.Context) error {
	if time.Since(b.purged) < time.Minute {
		return nil
	}
	age := b.retention.Microseconds()
	if _, err := b.db.Exec(ctx, `DELETE FROM batch_items WHERE state IN ('done', 'failed') AND updated_at < now() - $1::bigint * interval '1 microsecond'`, age); err != nil {
		return PostgresError(err)
	}
	if _, err := b.db.Exec(ctx, `DELETE FROM batch_submissions s WHERE state = 'ended' AND ended_at < now() - $1::bigint * interval '1 microsecond'
	AND NOT EXISTS (SELECT 1 FROM batch_items i WHERE i.submission = s.id)`, age); err != nil {
		return PostgresError(err)
	}
	b.purged = time.Now()
	return nil
}

// recover settles each submission left "submitting" (its record committed, its batch id
// not): the batch is looked for at the provider, by the submission id in its metadata,
// else (a provider without metadata) as the one batch no submission knows created since,
// of as many items; found, its id is recorded; not found, it is submitted again. One
// process submits at a time (the lock), so no other submission can be in flight.
func (b *batchLane) recover(ctx context.Context) error {
	type open struct {
		id, model string
		items     int
		at        time.Time
	}
	// Only those last sent longer ago than two submissions can take (SubmitTimeout): no
	// process can still be uploading or creating them (PostgreSQL's clock on both ends).
	subs, err := queryRows(ctx, b.db, `SELECT id::text, model, items, created_at FROM batch_submissions
WHERE state = 'submitting' AND attempted_at < now() - $1::bigint * interval '1 microsecond' ORDER BY created_at`,
		[]any{(2 * b.cfg.SubmitTimeout).Microseconds()},
		func(row pgx.CollectableRow) (s open, err error) { return s, row.Scan(&s.id, &s.model, &s.items, &s.at) })
	if err != nil {
		return err
	}
	for _, s := range subs {
		found, err := b.find(ctx, s.id, s.items, s.at)
		if errors.Is(err, errAmbiguousBatch) { // the others, and the rest of the round, go on
			b.log.ErrorContext(ctx, "onceflow: batch lane: a submission's batch cannot be told apart at the provider; its requests fall back to the synchronous lane when their steps' waits end", "err", err)
			continue
		}
		if err != nil {
			b.log.WarnContext(ctx, "onceflow: batch lane: settle a submission", "submission", s.id, "err", err)
			continue
		}
		if found != "" {
			b.log.InfoContext(ctx, "onceflow: batch found at the provider after a crash; recorded", "submission", s.id, "batch", found)
			if err := b.submitted(ctx, s.id, found); err != nil {
				return err
			}
			continue
		}
		items, err := b.itemsOf(ctx, s.id)
		if err != nil {
			return err
		}
		if _, err := b.db.Exec(ctx, `UPDATE batch_submissions SET attempted_at = now() WHERE id = $1`, s.id); err != nil {
			return PostgresError(err)
		}
		if err := b.send(ctx, llm.BatchSubmission{ID: s.id, Model: s.model, Items: items}); err != nil {
			b.log.WarnContext(ctx, "onceflow: batch lane: send a submission again", "submission", s.id, "err", err)
		}
	}
	return nil
}

// findMargin is how long before a submission's record find lists the provider's
// batches from: the provider's clock may be behind PostgreSQL's.
const findMargin = 15 * time.Minute

// find looks for submission id's batch at the provider: "" when it is not there.
func (b *batchLane) find(ctx context.Context, id string, items int, at time.Time) (string, error) {
	since := at.Add(-findMargin)
	infos, err := b.cfg.API.List(ctx, since)
	if err != nil {
		return "", fmt.Errorf("onceflow: batch lane: list the provider's batches: %w", err)
	}
	var candidates []string
	for _, in := range infos {
		if in.Submission == id {
			return in.ID, nil
		}
		if in.Submission == "" && in.Items == items && !in.CreatedAt.Before(since) {
			candidates = append(candidates, in.ID)
		}
	}
	if len(candidates) == 0 {
		return "", nil
	}
	known, err := queryRows(ctx, b.db, `SELECT batch_id FROM batch_submissions WHERE batch_id = ANY($1)`, []any{candidates}, pgx.RowTo[string])
	if err != nil {
		return "", err
	}
	var unknown []string
	for _, c := range candidates {
		if !slices.Contains(known, c) {
			unknown = append(unknown, c)
		}
	}
	switch len(unknown) {
	case 0:
		return "", nil
	case 1:
		return unknown[0], nil
	}
	return "", fmt.Errorf("%w: submission %s: %d batches at the provider could be it; resolve by hand (docs/batch.md)", errAmbiguousBatch, id, len(unknown))
}

// errAmbiguousBatch is find's error when more than one unknown batch at the provider
// could be a submission's.
var errAmbiguousBatch = errors.New("onceflow: batch lane: ambiguous batch")

// itemsOf returns submission id's items.
func (b *batchLane) itemsOf(ctx context.Context, id string) ([]llm.BatchItem, error) {
	return queryRows(ctx, b.db, `SELECT custom_id, request FROM batch_items WHERE submission = $1 ORDER BY created_at`, []any{id}, scanBatchItem)
}

// scanBatchItem reads a row of custom_id and request as the item a batch sends.
func scanBatchItem(row pgx.CollectableRow) (llm.BatchItem, error) {
	var it llm.BatchItem
	var body []byte
	if err := row.Scan(&it.CustomID, &body); err != nil {
		return it, err
	}
	return it, decodeBatchRequest(&it, body)
}

// decodeBatchRequest decodes a stored request into it.
func decodeBatchRequest(it *llm.BatchItem, body []byte) error {
	if err := json.Unmarshal(body, &it.Request); err != nil {
		return fmt.Errorf("onceflow: batch lane: item %s: %w", it.CustomID, err)
	}
	return nil
}

// queryRows runs query with args and returns its rows as scan reads them.
func queryRows[T any](ctx context.Context, db *pgxpool.Pool, query string, args []any, scan pgx.RowToFunc[T]) ([]T, error) {
	rows, err := db.Query(ctx, query, args...)
	if err != nil {
		return nil, PostgresError(err)
	}
	out, err := pgx.CollectRows(rows, scan)
	return out, PostgresError(err)
}

// submitDue sends, for each model, its pending requests as batches of MaxItems (and
// MaxBytes) while a batch is full or the oldest has waited MaxAge, as far as the
// model's EnqueuedTokens allow.
func (b *batchLane) submitDue(ctx context.Context) error {
	type due struct {
		model    string
		n        int
		bytes    int64
		old      bool
		inFlight int64
	}
	dues, err := queryRows(ctx, b.db, `SELECT p.model, p.n, p.bytes, p.old, coalesce(f.tokens, 0) FROM (
	SELECT model, count(*) AS n, sum(octet_length(request))::bigint AS bytes,
		now() - min(created_at) >= $1::bigint * interval '1 microsecond' AS old
	FROM batch_items WHERE state = 'pending' GROUP BY model) p
LEFT JOIN (SELECT model, sum(tokens)::bigint AS tokens FROM batch_submissions WHERE state <> 'ended' GROUP BY model) f USING (model)`,
		[]any{b.cfg.MaxAge.Microseconds()},
		func(row pgx.CollectableRow) (d due, err error) {
			return d, row.Scan(&d.model, &d.n, &d.bytes, &d.old, &d.inFlight)
		})
	if err != nil {
		return err
	}
	for _, d := range dues {
		limit, limited := b.enqueuedLimit(d.model)
		full := d.n >= b.cfg.MaxItems || d.bytes >= b.cfg.MaxBytes
		for n := d.n; n > 0 && (full || d.old); {
			var room *int64 // tokens the model may still enqueue; nil: no limit
			if limited {
				r := max(limit-d.inFlight, 0)
				room = &r
			}
			taken, tokens, err := b.take(ctx, d.model, room, d.inFlight == 0)
			if err != nil {
				b.log.WarnContext(ctx, "onceflow: batch lane: send a batch", "model", d.model, "err", err)
			}
			if err != nil || taken == 0 { // the next model's turn
				break
			}
			n -= taken
			d.inFlight += tokens
			full = n >= b.cfg.MaxItems // bytes: the next take sees what is left
		}
	}
	return nil
}

// enqueuedLimit is model's EnqueuedTokens ("*" for the models not listed).
func (b *batchLane) enqueuedLimit(model string) (int64, bool) {
	if n, ok := b.cfg.EnqueuedTokens[model]; ok {
		return n, true
	}
	n, ok := b.cfg.EnqueuedTokens["*"]
	return n, ok
}

// takeSQL moves a model's oldest pending requests, as many as fit in a batch (count,
// bytes) and in the model's room for enqueued tokens, into a new submission, committed
// before anything is uploaded; it returns them. The first request is taken whatever its
// size when alone is true (nothing of the model in flight), so that one larger than a
// limit is still sent, alone.
//
//	$1 model, $2 MaxItems, $3 submission id, $4 MaxBytes, $5 token room (NULL: no limit), $6 alone
const takeSQL = `WITH ordered AS (
	SELECT key, sum(octet_length(request)) OVER w AS bytes, sum(tokens) OVER w AS tokens, row_number() OVER w AS n
	FROM batch_items WHERE state = 'pending' AND model = $1
	WINDOW w AS (ORDER BY created_at, key) ORDER BY created_at, key LIMIT $2),
picked AS (SELECT key FROM ordered WHERE (bytes <= $4 AND ($5::bigint IS NULL OR tokens <= $5)) OR (n = 1 AND ($6 OR $5::bigint IS NULL))),
upd AS (UPDATE batch_items i SET state = 'submitted', submission = $3, updated_at = now() FROM picked
	WHERE i.key = picked.key AND i.state = 'pending'
	RETURNING i.custom_id, i.request, i.tokens),
sub AS (INSERT INTO batch_submissions (id, model, state, items, tokens) SELECT $3, $1, 'submitting', count(*), sum(tokens) FROM upd HAVING count(*) > 0)
SELECT custom_id, request, tokens FROM upd`

// take moves up to a batch of model's pending requests into a new submission (takeSQL)
// and sends it; it returns how many requests it took and their tokens.
func (b *batchLane) take(ctx context.Context, model string, room *int64, alone bool) (int, int64, error) {
	id := uuid.NewString()
	var tokens int64
	items, err := queryRows(ctx, b.db, takeSQL, []any{model, b.cfg.MaxItems, id, b.cfg.MaxBytes, room, alone},
		func(row pgx.CollectableRow) (llm.BatchItem, error) {
			var it llm.BatchItem
			var body []byte
			var n int64
			if err := row.Scan(&it.CustomID, &body, &n); err != nil {
				return it, err
			}
			tokens += n
			return it, decodeBatchRequest(&it, body)
		})
	if err != nil || len(items) == 0 {
		return 0, 0, err
	}
	return len(items), tokens, b.send(ctx, llm.BatchSubmission{ID: id, Model: model, Items: items})
}

// send creates submission s's batch at the provider, within SubmitTimeout, and records
// its id. An item the adapter cannot send (llm.BatchItemError, before anything reached
// the provider) fails alone, its job woken to make its call in the synchronous lane,
// and the others are sent. Another failure leaves the submission "submitting", for
// recover to settle.
func (b *batchLane) send(ctx context.Context, s llm.BatchSubmission) error {
	for len(s.Items) > 0 {
		sctx, cancel := context.WithTimeout(ctx, b.cfg.SubmitTimeout)
		info, err := b.cfg.API.Submit(sctx, s)
		cancel()
		var ie *llm.BatchItemError
		if errors.As(err, &ie) {
			i := slices.IndexFunc(s.Items, func(it llm.BatchItem) bool { return it.CustomID == ie.CustomID })
			if i < 0 {
				return fmt.Errorf("onceflow: batch lane: submission %s: the provider's adapter refused item %s, which it does not hold: %w", s.ID, ie.CustomID, err)
			}
			if err := b.dropItem(ctx, s.ID, ie.CustomID, err.Error()); err != nil {
				return err
			}
			s.Items = slices.Delete(s.Items, i, i+1)
			continue
		}
		if err != nil {
			return fmt.Errorf("onceflow: batch lane: submit %d requests of %s (submission %s): %w", len(s.Items), s.Model, s.ID, err)
		}
		b.log.InfoContext(ctx, "onceflow: batch submitted", "submission", s.ID, "batch", info.ID, "model", s.Model, "items", len(s.Items))
		return b.submitted(ctx, s.ID, info.ID)
	}
	_, err := b.db.Exec(ctx, `UPDATE batch_submissions SET state = 'ended', ended_at = now(), error = 'every request refused by the adapter' WHERE id = $1`, s.ID)
	return PostgresError(err)
}

// dropItem fails the item custom_id of submission id before it was sent (why), takes
// it out of the submission and wakes its job.
func (b *batchLane) dropItem(ctx context.Context, id, custom, why string) error {
	why = clipRunes(why, 500)
	its, err := queryRows(ctx, b.db, `WITH it AS (UPDATE batch_items SET state = 'failed', error = $3, request = ''::bytea, updated_at = now()
	WHERE submission = $1 AND custom_id = $2 AND state = 'submitted' RETURNING key, tenant, job_id, queue, tokens),
sub AS (UPDATE batch_submissions s SET items = s.items - 1, tokens = s.tokens - it.tokens FROM it WHERE s.id = $1)
SELECT key, tenant, job_id, queue FROM it`, []any{id, custom, why}, func(row pgx.CollectableRow) (it batchItem, err error) {
		return it, row.Scan(&it.key, &it.tenant, &it.jobID, &it.queue)
	})
	if err != nil {
		return err
	}
	for _, it := range its {
		b.log.WarnContext(ctx, "onceflow: batch lane: a request the provider's adapter cannot send; its job makes it in the synchronous lane", "job_id", it.jobID, "err", why)
		if err := b.wake(ctx, it, batchSignal{Error: why}); err != nil {
			return err
		}
	}
	return nil
}

// submitted records submission id's batch id.
func (b *batchLane) submitted(ctx context.Context, id, batchID string) error {
	_, err := b.db.Exec(ctx, `UPDATE batch_submissions SET state = 'submitted', batch_id = $2, submitted_at = now() WHERE id = $1 AND state = 'submitting'`, id, batchID)
	return PostgresError(err)
}

// batchSignal is the payload of the signal that wakes a job whose batch item ended.
type batchSignal struct {
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

// poll records the results of every submitted batch that ended: each answer in the
// ledger, each item done or failed, and its job woken. It runs again over a batch whose
// recording a crash interrupted: the ledger keeps the first answer, and a signal again
// is a retry.
func (b *batchLane) poll(ctx context.Context) error {
	subs, err := queryRows(ctx, b.db, `SELECT id::text, batch_id FROM batch_submissions WHERE state = 'submitted' ORDER BY submitted_at`, nil,
		func(row pgx.CollectableRow) (s [2]string, err error) { return s, row.Scan(&s[0], &s[1]) })
	if err != nil {
		return err
	}
	for _, s := range subs {
		info, err := b.cfg.API.Get(ctx, s[1])
		if IsPermanent(err) { // gone at the provider (a 404 past its retention): nothing more will come
			b.log.ErrorContext(ctx, "onceflow: batch lane: a batch the provider no longer answers for; its requests are made in the synchronous lane", "batch", s[1], "err", err)
			if err := b.end(ctx, s[0], "the provider no longer answers for its batch: "+err.Error()); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			b.log.WarnContext(ctx, "onceflow: batch lane: look at a batch", "batch", s[1], "err", err)
			continue
		}
		if !info.Ended {
			continue
		}
		if err := b.record(ctx, s[0], s[1]); err != nil {
			if errors.Is(err, ErrUnavailable) {
				return err
			}
			b.log.WarnContext(ctx, "onceflow: batch lane: record a batch's results", "batch", s[1], "err", err)
		}
	}
	return nil
}

// batchItem is a submitted item as the poller records it.
type batchItem struct {
	customID, key, work, hash, model, tenant, jobID, queue string
	request                                                []byte
}

// endSQL marks a submission's items done or failed (with their errors; their request
// bodies, needed no more, dropped) and the submission ended, in one statement.
//
//	$1 submission id, $2 keys, $3 their states, $4 their errors ("" for none)
const endSQL = `WITH items AS (
	UPDATE batch_items i SET state = u.state, error = nullif(u.error, ''), request = ''::bytea, updated_at = now()
	FROM unnest($2::text[], $3::text[], $4::text[]) AS u(key, state, error) WHERE i.key = u.key)
UPDATE batch_submissions SET state = 'ended', ended_at = now() WHERE id = $1`

// record records ended batch batchID of submission id: each answer in the ledger, each
// job woken, then every item's state and the submission's end in one statement. A crash
// before that statement leaves the items submitted: the next round records them again
// (the ledger keeps the first answer, a signal again is a retry).
func (b *batchLane) record(ctx context.Context, id, batchID string) error {
	items, err := b.submittedItems(ctx, id)
	if err != nil {
		return err
	}
	var e ending
	c := b.c
	for r, err := range b.cfg.API.Results(ctx, batchID) {
		if errors.Is(err, llm.ErrBatchResult) { // its item, if ours, ends "no result" below
			b.log.WarnContext(ctx, "onceflow: batch lane: a result of the batch cannot be read", "batch", batchID, "err", err)
			continue
		}
		if err != nil {
			return fmt.Errorf("onceflow: batch lane: results of batch %s: %w", batchID, err)
		}
		it, ok := items[r.CustomID]
		if !ok {
			continue // recorded by an earlier pass, or not ours
		}
		delete(items, r.CustomID)
		why := ""
		if r.Outcome == llm.BatchSucceeded && r.Response != nil {
			call := ledger.Call{Key: it.key, Work: it.work, RequestHash: it.hash, Provider: c.model.provider + ledger.BatchSuffix, Model: it.model,
				Tenant: it.tenant}
			if b.keepRequests {
				call.Request = it.request
			}
			recorded, err := c.model.ledger.Record(ctx, nil, call, ledger.ResultOf(r.Response))
			if err != nil && !errors.Is(err, ledger.ErrKeyReused) {
				return fmt.Errorf("onceflow: batch lane: record %s: %w", it.key, err)
			}
			if recorded { // at the batch price, in the cost view; once: a second pass records nothing
				c.model.limiter.AccountBatch(it.tenant, it.model, r.Response.Usage)
			}
		} else {
			why = cmp.Or(r.Error, r.Outcome)
		}
		if err := b.settle(ctx, &e, it, why); err != nil {
			return err
		}
	}
	for _, it := range items { // no result: the provider dropped it
		if err := b.settle(ctx, &e, it, "no result in its batch"); err != nil {
			return err
		}
	}
	return b.finish(ctx, id, &e)
}

// ending collects the items of a submission that ends, as they settle, for endSQL.
type ending struct{ keys, states, whys []string }

// settle settles item it: answered (why "") or failed with why; its job is woken.
func (b *batchLane) settle(ctx context.Context, e *ending, it batchItem, why string) error {
	why = clipRunes(why, 500)
	state := "done"
	if why != "" {
		state = "failed"
	}
	e.keys, e.states, e.whys = append(e.keys, it.key), append(e.states, state), append(e.whys, why)
	return b.wake(ctx, it, batchSignal{OK: why == "", Error: why})
}

// finish marks submission id's settled items and the submission ended, in one
// statement.
func (b *batchLane) finish(ctx context.Context, id string, e *ending) error {
	_, err := b.db.Exec(ctx, endSQL, id, e.keys, e.states, e.whys)
	return PostgresError(err)
}

// submittedItems returns submission id's items still submitted, by custom_id.
func (b *batchLane) submittedItems(ctx context.Context, id string) (map[string]batchItem, error) {
	list, err := queryRows(ctx, b.db, `SELECT custom_id, key, work, request_hash, model, tenant, job_id, queue, request FROM batch_items
WHERE submission = $1 AND state = 'submitted'`, []any{id}, func(row pgx.CollectableRow) (it batchItem, err error) {
		return it, row.Scan(&it.customID, &it.key, &it.work, &it.hash, &it.model, &it.tenant, &it.jobID, &it.queue, &it.request)
	})
	if err != nil {
		return nil, err
	}
	items := make(map[string]batchItem, len(list))
	for _, it := range list {
		items[it.customID] = it
	}
	return items, nil
}

// end ends submission id without its results (its batch is gone at the provider):
// each of its items still submitted fails with why, and its job is woken.
func (b *batchLane) end(ctx context.Context, id, why string) error {
	items, err := b.submittedItems(ctx, id)
	if err != nil {
		return err
	}
	var e ending
	for _, it := range items {
		if err := b.settle(ctx, &e, it, why); err != nil {
			return err
		}
	}
	return b.finish(ctx, id, &e)
}

// wake wakes item it's job with sig, on its queue (read from the item, whether or not
// this process works it: no search through the Client's queues).
func (b *batchLane) wake(ctx context.Context, it batchItem, sig batchSignal) error {
	_, err := b.c.signalIn(ctx, it.queue, it.tenant, it.jobID, batchPrefix+it.key, sig)
	switch {
	case err == nil, errors.Is(err, ErrAlreadySignalled):
		return nil
	case errors.Is(err, ErrJobNotFound):
		b.log.WarnContext(ctx, "onceflow: batch answer of a job that is gone", "job_id", it.jobID, "key", it.key)
		return nil
	}
	return fmt.Errorf("onceflow: batch lane: wake job %s: %w", it.jobID, err)
}

// BatchRecord is a batch of the lane, as Inspector.Batches lists it.
type BatchRecord struct {
	// Submission is the lane's id of the batch, committed before it was uploaded.
	Submission string `json:"submission"`
	// BatchID is the provider's id ("" while it is being submitted).
	BatchID string `json:"batch_id,omitempty"`
	Model   string `json:"model"`
	// State is "submitting" (recorded, the provider's id not yet), "submitted"
	// (at the provider) or "ended" (its results recorded).
	State string `json:"state"`
	// Items counts its requests, Tokens their estimated input tokens; Done and Failed
	// count the requests answered and those that fell back to the synchronous lane
	// (errored, expired, cancelled) once the batch ended.
	Items  int   `json:"items"`
	Tokens int64 `json:"tokens"`
	Done   int   `json:"done"`
	Failed int   `json:"failed"`
	// CreatedAt is when the submission was recorded; SubmittedAt when the provider's id
	// was, EndedAt when its results were (nil until then).
	CreatedAt   time.Time  `json:"created_at"`
	SubmittedAt *time.Time `json:"submitted_at,omitempty"`
	EndedAt     *time.Time `json:"ended_at,omitempty"`
}

// BatchLane is the batch lane's state (Inspector.Batches): the requests waiting for a
// batch, by model, and the batches, newest first.
type BatchLane struct {
	Pending map[string]int `json:"pending"`
	Batches []BatchRecord  `json:"batches"`
}

// batchRecordSQL reads batch_submissions rows as BatchRecords, with their items' counts.
const batchRecordSQL = `SELECT s.id::text, coalesce(s.batch_id, ''), s.model, s.state, s.items, s.tokens,
	(SELECT count(*) FILTER (WHERE i.state = 'done') FROM batch_items i WHERE i.submission = s.id),
	(SELECT count(*) FILTER (WHERE i.state = 'failed') FROM batch_items i WHERE i.submission = s.id),
	s.created_at, s.submitted_at, s.ended_at
FROM batch_submissions s `

func scanBatchRecord(row pgx.CollectableRow) (r BatchRecord, err error) {
	return r, row.Scan(&r.Submission, &r.BatchID, &r.Model, &r.State, &r.Items, &r.Tokens, &r.Done, &r.Failed,
		&r.CreatedAt, &r.SubmittedAt, &r.EndedAt)
}

// Batches returns the batch lane's state: the requests waiting for a batch, by model,
// and the newest limit batches (1 to 1000; 0 is 100). Without Config.DB it returns an
// empty lane.
func (in *Inspector) Batches(ctx context.Context, limit int) (*BatchLane, error) {
	out := &BatchLane{Pending: map[string]int{}, Batches: []BatchRecord{}}
	db := in.c.cfg.DB
	if db == nil {
		return out, nil
	}
	if limit < 0 || limit > 1000 {
		return nil, fmt.Errorf("onceflow: Batches: limit %d is not 0 to 1000", limit)
	}
	pending, err := queryRows(ctx, db, `SELECT model, count(*) FROM batch_items WHERE state = 'pending' GROUP BY model`, nil,
		func(row pgx.CollectableRow) (p struct {
			model string
			n     int
		}, err error) {
			return p, row.Scan(&p.model, &p.n)
		})
	if err != nil {
		return nil, err
	}
	for _, p := range pending {
		out.Pending[p.model] = p.n
	}
	out.Batches, err = queryRows(ctx, db, batchRecordSQL+`ORDER BY s.created_at DESC LIMIT $1`, []any{cmp.Or(limit, 100)}, scanBatchRecord)
	return out, err
}

// CancelBatch asks the provider to cancel a batch of the lane, named by its submission
// id or the provider's batch id. The batch ends early at the provider; the lane then
// records its results as for any ended batch: the requests answered before the cancel
// are recorded, the others are made in the synchronous lane, once. It returns the batch
// as it stood; a batch that ended, or whose submission is not recorded yet, is
// ErrBatchNotCancellable, an unknown id ErrBatchNotFound. It needs Config.Batch.API.
func (c *Client) CancelBatch(ctx context.Context, id string) (BatchRecord, error) {
	if c.batch == nil {
		return BatchRecord{}, errors.New("onceflow: CancelBatch: the client has no batch lane (Config.Batch.API)")
	}
	recs, err := queryRows(ctx, c.batch.db, batchRecordSQL+`WHERE s.id::text = $1 OR s.batch_id = $1`, []any{id}, scanBatchRecord)
	switch {
	case err != nil:
		return BatchRecord{}, err
	case len(recs) == 0:
		return BatchRecord{}, fmt.Errorf("%w: %q", ErrBatchNotFound, id)
	}
	r := recs[0]
	if r.State != "submitted" {
		return r, fmt.Errorf("%w: batch %s is %s", ErrBatchNotCancellable, r.Submission, r.State)
	}
	if err := c.batch.cfg.API.Cancel(ctx, r.BatchID); err != nil {
		return r, fmt.Errorf("onceflow: cancel batch %s: %w", r.BatchID, err)
	}
	c.log.InfoContext(ctx, "onceflow: batch cancelled at the provider", "submission", r.Submission, "batch", r.BatchID, "items", r.Items)
	return r, nil
}
