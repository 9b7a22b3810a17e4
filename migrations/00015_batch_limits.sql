-- onceflow schema, version 15: the batch lane's limits and wake-ups. Each request's
-- input tokens as estimated when it joined the lane, and each batch's sum, so the
-- submitter can keep a model's batches in flight under the provider's queue limit
-- (BatchConfig.EnqueuedTokens); each request's job's queue, so the poller wakes a job
-- whatever queues its own process works; and when each submission was last sent.

-- +goose Up
ALTER TABLE batch_items ADD COLUMN tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE batch_items ADD COLUMN queue text NOT NULL DEFAULT '';
ALTER TABLE batch_submissions ADD COLUMN tokens bigint NOT NULL DEFAULT 0;
-- When the submission was last sent: a crash's or a failure's is settled only once no
-- process can still be sending it (BatchConfig.SubmitTimeout).
ALTER TABLE batch_submissions ADD COLUMN attempted_at timestamptz NOT NULL DEFAULT now();
-- The purge of ended requests (kept as long as the ledger's rows).
CREATE INDEX batch_items_ended ON batch_items (updated_at) WHERE state IN ('done', 'failed');

-- +goose Down
DROP INDEX batch_items_ended;
ALTER TABLE batch_submissions DROP COLUMN attempted_at;
ALTER TABLE batch_submissions DROP COLUMN tokens;
ALTER TABLE batch_items DROP COLUMN queue;
ALTER TABLE batch_items DROP COLUMN tokens;
