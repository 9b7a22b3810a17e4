-- onceflow schema, version 1: the tables of CONTRACT section 5 and the constraints the
-- guarantees rest on.

-- +goose Up

-- One row per finished job. The primary key is the guarantee of seed 000: when two
-- deliveries of one job race, INSERT ... ON CONFLICT (job_id) DO NOTHING RETURNING lets
-- exactly one of them win, and only the winner writes the outbox row.
CREATE TABLE summaries (
    job_id     uuid        PRIMARY KEY,
    tenant     text        NOT NULL,
    summary    text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Side-effect intents, written in the same transaction as the result and drained by the
-- relay. dedupe_key is UNIQUE: the backstop if two writers ever both think they won, and
-- the idempotency key the relay hands to the provider.
CREATE TABLE outbox (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic           text        NOT NULL,
    dedupe_key      text        NOT NULL UNIQUE,
    payload         jsonb       NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    sent_at         timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- relay bookkeeping: when the row may next be tried, who holds it and until when
    -- (a lease, so no row lock is held across a network call), and when it gave up.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    claimed_by      text,
    claimed_until   timestamptz,
    exhausted_at    timestamptz,
    -- W3C traceparent of the transaction that wrote the row, so the send joins its trace.
    traceparent     text
);

-- The relay's claim: unsent, not exhausted rows in due order.
CREATE INDEX outbox_due ON outbox (next_attempt_at, id)
    WHERE sent_at IS NULL AND exhausted_at IS NULL;
-- Retention: sent rows by age, deleted in small batches.
CREATE INDEX outbox_sent ON outbox (sent_at) WHERE sent_at IS NOT NULL;
-- `onceflow outbox list --failed` and the audit's exhausted check.
CREATE INDEX outbox_exhausted ON outbox (exhausted_at) WHERE exhausted_at IS NOT NULL;

-- The client-side ledger of model calls (seed 001). A row is inserted in_flight before
-- the request goes out; the key is derived from the work (job id, step, request hash),
-- never from the attempt.
CREATE TABLE llm_calls (
    idem_key     text        PRIMARY KEY,
    state        text        NOT NULL CHECK (state IN ('in_flight', 'succeeded', 'failed')),
    request_hash text        NOT NULL,
    response     jsonb,
    -- the response exactly as received, for byte-identical replays (jsonb reorders keys)
    response_raw bytea,
    error        text,
    attempt      integer     NOT NULL DEFAULT 1,
    -- attempts that ended without knowing whether the provider did the work
    ambiguous    integer     NOT NULL DEFAULT 0,
    provider     text        NOT NULL DEFAULT '',
    model        text        NOT NULL DEFAULT '',
    -- the live attempt that owns an in_flight row, renewed while the call runs
    owner        text,
    lease_until  timestamptz,
    -- streamed output received so far, persisted in batches
    partial      text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);

-- Purging expired rows in batches.
CREATE INDEX llm_calls_expires ON llm_calls (expires_at);
-- Finding in_flight rows whose owner stopped renewing.
CREATE INDEX llm_calls_in_flight ON llm_calls (lease_until) WHERE state = 'in_flight';

-- +goose Down
DROP TABLE llm_calls;
DROP TABLE outbox;
DROP TABLE summaries;
