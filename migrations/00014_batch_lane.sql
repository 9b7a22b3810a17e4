-- onceflow schema, version 14: the batch lane (Config.Batch, onceflow.InBatch): model
-- calls sent through a provider's batch API at its batch price, exactly once.

-- +goose Up

-- One row per model call in the batch lane, keyed by its ledger key. A job whose step
-- takes the lane inserts it pending (once: the key) and parks; the submitter moves
-- pending rows into a submission; the poller records each result in the ledger
-- (llm_calls), marks the row done or failed and wakes the job, which reads the answer
-- from the ledger (or, failed, makes the call in the synchronous lane).
CREATE TABLE batch_items (
    key          text        PRIMARY KEY,
    -- the provider's custom_id: the 64 hex digits of the key (Anthropic allows 64)
    custom_id    text        NOT NULL UNIQUE,
    work         text        NOT NULL,
    request_hash text        NOT NULL,
    model        text        NOT NULL,
    -- the request as JSON (llm.Request)
    request      bytea       NOT NULL,
    tenant       text        NOT NULL DEFAULT '',
    job_id       text        NOT NULL,
    state        text        NOT NULL CHECK (state IN ('pending', 'submitted', 'done', 'failed')),
    submission   uuid,
    error        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
-- The submitter's pick: the oldest pending rows of a model.
CREATE INDEX batch_items_pending ON batch_items (model, created_at) WHERE state = 'pending';
-- A submission's rows, for its results.
CREATE INDEX batch_items_submission ON batch_items (submission) WHERE submission IS NOT NULL;

-- One row per batch, committed before anything is uploaded: state submitting until the
-- provider's batch id is recorded (a crash in between is resolved by finding the batch
-- at the provider by this id, in its metadata, before submitting again), submitted until
-- its results are recorded, then ended.
CREATE TABLE batch_submissions (
    id           uuid        PRIMARY KEY,
    model        text        NOT NULL,
    state        text        NOT NULL CHECK (state IN ('submitting', 'submitted', 'ended')),
    batch_id     text        UNIQUE,
    items        integer     NOT NULL,
    error        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    submitted_at timestamptz,
    ended_at     timestamptz
);
CREATE INDEX batch_submissions_open ON batch_submissions (created_at) WHERE state <> 'ended';

-- +goose Down
DROP TABLE batch_submissions;
DROP TABLE batch_items;
