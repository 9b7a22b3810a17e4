package ledger

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// DB is what the ledger needs from PostgreSQL: *pgxpool.Pool, *pgx.Conn and pgx.Tx have
// it.
type DB interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// States of an llm_calls row (migrations/00001_schema.sql; docs/providers.md).
const (
	StateInFlight  = "in_flight"
	StateSucceeded = "succeeded"
	StateFailed    = "failed"
)

// Defaults of Config's fields.
const (
	DefaultLease               = 15 * time.Second
	DefaultRetention           = 24 * time.Hour
	DefaultWait                = 10 * time.Second
	DefaultWriteTimeout        = 5 * time.Second
	DefaultPurgeInterval       = time.Minute
	DefaultPurgeBatch          = 1000
	DefaultStreamFlushBytes    = 1024
	DefaultStreamFlushInterval = 500 * time.Millisecond
	// waitBase and waitCap bound the polls of a Begin that waits for a live owner.
	waitBase = 25 * time.Millisecond
	waitCap  = time.Second
)

var (
	// ErrInFlight is matched by the *InFlightError Begin returns when a live attempt
	// owns the call and did not finish within Config.Wait. It is retryable (HTTP 409,
	// retry.ClassConflict): try again later, the row will hold a response or be free.
	ErrInFlight = errors.New("ledger: call in flight in another attempt")
	// ErrKeyReused is matched by the permanent error Begin and Succeed return when a key
	// is recorded with another request hash: a key reused for another request, a bug of
	// the caller (Key never does this).
	ErrKeyReused = errors.New("ledger: key reused with another request")
	// ErrNotFound is returned by Get for a key with no row.
	ErrNotFound = errors.New("ledger: no such call")
	// ErrUnavailable is matched by the errors of a database operation that failed
	// (PostgreSQL down, a connection lost, a statement cancelled). They report HTTP 503
	// to package retry, so they are retried, and a job handler leaves the job for
	// redelivery instead of dead-lettering it.
	ErrUnavailable = errors.New("ledger: database unavailable")
	// ErrNoWork is matched by Client's error for a request without IdempotencyKey: the
	// ledger needs the work a call belongs to (see Work).
	ErrNoWork = errors.New("ledger: request has no IdempotencyKey naming its work")
)

// Config configures a Ledger. The zero value (with DB) works: every zero field takes
// its default.
type Config struct {
	// Lease is how long a row stays owned by an attempt that stopped renewing it
	// (ONCEFLOW_LEDGER_LEASE): after it, another attempt takes the row over, counting
	// the silent attempt as ambiguous. Live owners renew every Lease/3. Default: 15s.
	Lease time.Duration
	// Retention is how long a row is kept after its first attempt, and after its success
	// (ONCEFLOW_LEDGER_RETENTION): its expires_at, which a success moves to now +
	// Retention (never earlier). It must cover the retry horizon (every redelivery and
	// dead-letter replay of the work) plus the longest a job can wait in a queue, or a
	// late retry calls the model again. Default: 24h.
	Retention time.Duration
	// Wait bounds how long Begin waits, polling with backoff, for a live owner to
	// finish before returning an *InFlightError. Negative: never wait (onceflow
	// gateway answers 409 at once). Default: 10s (also capped by ctx's deadline).
	Wait time.Duration
	// RelaxedInsert commits the in-flight insert with synchronous_commit off (for that
	// statement only; ignored on a ledger over a pgx.Tx, whose commit is the caller's:
	// do not give the ledger a connection inside a transaction you opened). A crash of PostgreSQL within about 3×wal_writer_delay can then
	// lose the row: an accounting record (the attempt and its ambiguity), never an
	// effect, since every effect waits for the durable Succeed. Default: false.
	RelaxedInsert bool
	// WriteTimeout bounds Succeed, Fail and lease renewals, which run even when the
	// caller's context is already cancelled (a response that arrived is worth
	// recording), and each statement of Begin, Announce and AppendPartial (a PostgreSQL
	// that hangs fails them within it, not only at the caller's deadline). Default: 5s.
	WriteTimeout time.Duration
	// Owner names this process in the rows it owns (a random suffix is added per
	// attempt). Default: hostname:pid.
	Owner string
	// StreamFlushBytes and StreamFlushInterval batch the partial output Client.Stream
	// persists: a write when that much text is buffered or that much time passed since
	// the last write, whichever comes first, and one at the end. Defaults: 1024 bytes,
	// 500ms.
	StreamFlushBytes    int
	StreamFlushInterval time.Duration
	// PurgeInterval and PurgeBatch drive Run: expired rows are deleted every
	// PurgeInterval, PurgeBatch rows per statement. Defaults: 1m, 1000.
	PurgeInterval time.Duration
	PurgeBatch    int
	// KeepRequests has Client store each call's request on its row (Call.Request), for
	// as long as the row (Retention): the inputs offline evaluation (`onceflow eval`)
	// replays. It costs the request's bytes on every in-flight insert (about 7 % of the
	// goodput of 20 ms calls with 2 KB requests; docs/BENCHMARKS.md). Default: false.
	KeepRequests bool
	// Clock, when set, is the time source of leases, expiry and waits, for tests; the
	// SQL then compares against its Now instead of PostgreSQL's now(). Default: nil
	// (PostgreSQL's clock for rows, so processes with skewed clocks agree; the system
	// clock for waiting).
	Clock retry.Clock
	// GroupLinger and GroupMax drive group commit: the in-flight rows and answers of
	// concurrent calls in this process share one transaction, one round trip and one
	// WAL flush when they arrive together, with the same guarantees per call (a call
	// goes out only after its own row committed; a group that fails is written again
	// call by call, so each call gets its own outcome). While a group is in flight the
	// next one collects what arrives; the first write of a group also waits GroupLinger
	// for others when other calls of the ledger are in progress (a call alone waits
	// none). GroupLinger: 0 takes DefaultGroupLinger (100µs), at most MaxGroupLinger
	// (5ms); negative turns group commit off (every write commits alone, as on a
	// pgx.Tx or a DB that cannot send batches). GroupMax bounds the writes of one group
	// (default 64). See docs/providers.md, "Group commit".
	GroupLinger time.Duration
	GroupMax    int
	// Rand draws the jitter of waits. Default: math/rand/v2.
	Rand retry.Rand
	// Models are the model names expected in Call.Model, initialised as metric labels.
	// Other names are labelled as they come, up to 32, then "other".
	Models []string
	// Logger receives the ledger's logs. Default: slog.Default().
	Logger *slog.Logger
	// Registerer exports the ledger's metrics; nil leaves them unexported.
	Registerer prometheus.Registerer
}

// Ledger is the client-side record of model calls (docs/providers.md): one llm_calls row per
// call, inserted in_flight before the request goes out, so that a retry, a redelivery
// or a second worker finds what happened instead of calling again. It is safe for
// concurrent use.
type Ledger struct {
	db      DB
	sql     statements
	cfg     Config
	log     *slog.Logger
	metrics *ledgerMetrics
	// active counts the calls between Begin and the end of their attempt: a group's
	// first write lingers only when others may join it.
	active atomic.Int64
	// inserts, answers and relaxedAnswers group the writes of Begin and Succeed (nil:
	// group commit off).
	inserts, answers, relaxedAnswers *group
}

// New returns a Ledger over db, a PostgreSQL database migrated by onceflow (the
// llm_calls and llm_tool_calls tables). It fails only when db is nil or a setting is
// negative.
func New(db DB, cfg Config) (*Ledger, error) {
	if db == nil {
		return nil, errors.New("ledger: DB is required")
	}
	if cfg.Lease < 0 || cfg.Retention < 0 || cfg.WriteTimeout < 0 || cfg.StreamFlushBytes < 0 ||
		cfg.StreamFlushInterval < 0 || cfg.PurgeInterval < 0 || cfg.PurgeBatch < 0 || cfg.GroupMax < 0 {
		return nil, errors.New("ledger: negative setting")
	}
	if cfg.GroupLinger > MaxGroupLinger {
		return nil, fmt.Errorf("ledger: GroupLinger %s is more than %s", cfg.GroupLinger, MaxGroupLinger)
	}
	cfg.GroupLinger = cmp.Or(cfg.GroupLinger, DefaultGroupLinger)
	cfg.GroupMax = cmp.Or(cfg.GroupMax, DefaultGroupMax)
	cfg.Lease = cmp.Or(cfg.Lease, DefaultLease)
	cfg.Retention = cmp.Or(cfg.Retention, DefaultRetention)
	cfg.Wait = cmp.Or(cfg.Wait, DefaultWait)
	cfg.WriteTimeout = cmp.Or(cfg.WriteTimeout, DefaultWriteTimeout)
	cfg.StreamFlushBytes = cmp.Or(cfg.StreamFlushBytes, DefaultStreamFlushBytes)
	cfg.StreamFlushInterval = cmp.Or(cfg.StreamFlushInterval, DefaultStreamFlushInterval)
	cfg.PurgeInterval = cmp.Or(cfg.PurgeInterval, DefaultPurgeInterval)
	cfg.PurgeBatch = cmp.Or(cfg.PurgeBatch, DefaultPurgeBatch)
	if cfg.Owner == "" {
		host, _ := os.Hostname()
		cfg.Owner = host + ":" + strconv.Itoa(os.Getpid())
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	l := &Ledger{db: db, sql: statementsFor(db, cfg), cfg: cfg, log: cfg.Logger, metrics: newMetrics(cfg.Registerer, cfg.Models)}
	l.inserts = l.newGroup(l.sql.insert, 1)
	l.answers = l.newGroup(l.sql.succeed, 0)
	l.relaxedAnswers = l.newGroup(l.sql.relaxedSucceed, 0)
	return l, nil
}

// statements are the ledger's SQL whose text depends on its configuration, built once.
type statements struct {
	insert, announce, appendPartial string
	// succeed records an answer durably; relaxedSucceed without waiting for the WAL
	// flush (DeferFlush), the same as succeed on a pgx.Tx.
	succeed, relaxedSucceed string
}

// statementsFor splices the relaxed commits into the statements that may have them
// (Config.RelaxedInsert; followerWrite always), except on a pgx.Tx, where the setting
// would last until the caller's commit.
func statementsFor(db DB, cfg Config) statements {
	_, inTx := db.(pgx.Tx)
	insert, follower := "", followerWrite
	if cfg.RelaxedInsert && !inTx {
		insert = relaxedCommit
	}
	if inTx {
		follower = ""
	}
	return statements{
		insert:         fmt.Sprintf(insertSQL, insert),
		announce:       fmt.Sprintf(announceSQL, follower),
		appendPartial:  fmt.Sprintf(appendPartialSQL, follower),
		succeed:        fmt.Sprintf(succeedSQL, ""),
		relaxedSucceed: fmt.Sprintf(succeedSQL, follower),
	}
}

// Lease returns the configured lease.
func (l *Ledger) Lease() time.Duration { return l.cfg.Lease }

// now is the clock parameter of every statement: the injected clock's time, or nil for
// PostgreSQL's now().
func (l *Ledger) now() *time.Time {
	if l.cfg.Clock == nil {
		return nil
	}
	t := l.cfg.Clock.Now()
	return &t
}

func (l *Ledger) clock() retry.Clock {
	if l.cfg.Clock == nil {
		return retry.SystemClock{}
	}
	return l.cfg.Clock
}

// micros renders a duration as the bigint microseconds the SQL adds to a timestamp.
func micros(d time.Duration) int64 { return d.Microseconds() }

// BatchSuffix ends the provider name of a call answered through the provider's batch
// API (onceflow's batch lane): "openai-batch", priced at the batch price.
const BatchSuffix = "-batch"

// Call identifies one model call to Begin.
type Call struct {
	// Key is the row's key: Key(work, req) for model calls. Required.
	Key string
	// Work is the readable name of the work (Work(jobID, step)), stored for people.
	Work string
	// RequestHash is RequestHash(req) (or the gateway's hash of the HTTP request): a
	// key recorded with another hash is ErrKeyReused. Required.
	RequestHash string
	// Provider and Model label the row and the metrics ("openai", "gpt-4.1-mini"); a
	// provider ending in BatchSuffix ("openai-batch") marks an answer that came through
	// the provider's batch API.
	Provider, Model string
	// Tenant is whose call it is, stored on the row for operators (ListOptions.Tenant);
	// "" for none. Client takes it from the context (llm.WithTenant).
	Tenant string
	// Request is the request as JSON (llm.Request), stored on the row for offline
	// evaluation (onceflow eval); nil stores none. Client fills it with
	// Config.KeepRequests.
	Request []byte
}

// Record is a succeeded call: what a repeat replays instead of calling again.
type Record struct {
	// Key is the row's key.
	Key string
	// Response is the recorded response as JSON (for model calls, an llm.Response; for
	// onceflow gateway, the upstream body when it is JSON).
	Response json.RawMessage
	// Raw is the response exactly as received, for byte-identical replay.
	Raw []byte
	// Meta is what an HTTP replay needs besides Raw (status, headers); nil for model
	// calls.
	Meta json.RawMessage
	// Attempt is the attempt number recorded on the row; Ambiguous the attempts that
	// ended without knowing whether the provider did the work.
	Attempt, Ambiguous int
}

// LLMResponse decodes a Record written by Client (or with ResultOf) into the
// llm.Response it recorded, Raw included.
func (r *Record) LLMResponse() (*llm.Response, error) {
	var resp llm.Response
	if err := json.Unmarshal(r.Response, &resp); err != nil {
		return nil, fmt.Errorf("ledger: decode recorded response of %s: %w", r.Key, err)
	}
	resp.Raw = r.Raw
	return &resp, nil
}

// Result is what Succeed records.
type Result struct {
	// Response is stored in the jsonb column; it must be valid JSON (or nil, stored as
	// SQL NULL).
	Response json.RawMessage
	// Raw is stored byte for byte, for replays.
	Raw []byte
	// Meta is stored as jsonb beside them (HTTP status and headers); nil for none.
	Meta json.RawMessage
}

// ResultOf is the Result of a model response: the llm.Response as JSON and its Raw
// bytes.
func ResultOf(resp *llm.Response) Result {
	b, _ := json.Marshal(resp) // an llm.Response always encodes
	return Result{Response: b, Raw: resp.Raw}
}

// InFlightError is ErrInFlight with the row's details. It reports HTTP 409 to package
// retry, so retry.Do retries it with backoff like a provider's "key in use".
type InFlightError struct {
	Key string
	// Attempt is the attempt number of the live owner.
	Attempt int
	// LeaseUntil is when the owner's lease runs out unless it renews it.
	LeaseUntil time.Time
}

// Error names the key, the owner's attempt and its lease.
func (e *InFlightError) Error() string {
	return fmt.Sprintf("ledger: call %s in flight in attempt %d (lease until %s)", e.Key, e.Attempt, e.LeaseUntil.UTC().Format(time.RFC3339))
}

// Is makes errors.Is(err, ErrInFlight) true.
func (e *InFlightError) Is(target error) bool { return target == ErrInFlight }

// HTTPStatus implements retry.HTTPStatuser: 409 Conflict, retryable.
func (e *InFlightError) HTTPStatus() int { return http.StatusConflict }

var _ retry.HTTPStatuser = (*InFlightError)(nil)

// Row is one llm_calls row as Get reads it; the fields are its columns (migrations
// 00001 and 00002), NULLs read as zero values.
type Row struct {
	Key, Work, State, RequestHash, Provider, Model string
	Attempt, Ambiguous                             int
	Owner                                          string
	LeaseUntil                                     time.Time
	Error                                          string
	Partial                                        string
	PartialAttempt                                 int
	Response                                       json.RawMessage
	Raw                                            []byte
	Meta                                           json.RawMessage
	CreatedAt, UpdatedAt, ExpiresAt                time.Time
}

const rowColumns = `idem_key, work, state, request_hash, provider, model, attempt, ambiguous,
	coalesce(owner, ''), coalesce(lease_until, 'epoch'), coalesce(error, ''), coalesce(partial, ''),
	coalesce(partial_attempt, 0), response, response_raw, response_meta, created_at, updated_at, expires_at`

func scanRow(row pgx.Row) (*Row, error) {
	var r Row
	err := row.Scan(&r.Key, &r.Work, &r.State, &r.RequestHash, &r.Provider, &r.Model, &r.Attempt, &r.Ambiguous,
		&r.Owner, &r.LeaseUntil, &r.Error, &r.Partial, &r.PartialAttempt, &r.Response, &r.Raw, &r.Meta,
		&r.CreatedAt, &r.UpdatedAt, &r.ExpiresAt)
	if err != nil {
		return nil, err
	}
	return &r, nil
}

// Get reads the row of key, for inspection and tests; ErrNotFound when there is none.
func (l *Ledger) Get(ctx context.Context, key string) (*Row, error) {
	r, err := scanRow(l.db.QueryRow(ctx, `SELECT `+rowColumns+` FROM llm_calls WHERE idem_key = $1`, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, dbError("read "+key, err)
	}
	return r, nil
}

// unavailableError is a failed database operation: it matches ErrUnavailable and the
// driver's error, and classifies as retryable (HTTP 503).
type unavailableError struct {
	op  string
	err error
}

func dbError(op string, err error) error { return &unavailableError{op: op, err: err} }

func (e *unavailableError) Error() string   { return "ledger: " + e.op + ": " + e.err.Error() }
func (e *unavailableError) Unwrap() []error { return []error{ErrUnavailable, e.err} }

// HTTPStatus implements retry.HTTPStatuser: 503, retryable.
func (e *unavailableError) HTTPStatus() int { return http.StatusServiceUnavailable }

// newOwner returns a fresh owner token for one attempt.
func (l *Ledger) newOwner() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return l.cfg.Owner + "/" + hex.EncodeToString(b[:])
}
