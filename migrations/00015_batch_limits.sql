-- onceflow schema, version 15: the batch lane's limits (BatchConfig.EnqueuedTokens): each
-- request's input tokens as estimated when it joined the lane, and each batch's sum, so
-- the submitter can keep a model's batches in flight under the provider's queue limit.

-- +goose Up
ALTER TABLE batch_items ADD COLUMN tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE batch_submissions ADD COLUMN tokens bigint NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE batch_submissions DROP COLUMN tokens;
ALTER TABLE batch_items DROP COLUMN tokens;
