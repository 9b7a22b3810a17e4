-- onceflow schema, version 13: the request of each model call, as JSON (llm.Request,
-- without its idempotency key), for offline evaluation (`onceflow eval`, Client.Eval):
-- recorded production inputs replayed against a candidate. NULL for a call recorded
-- before this version, through onceflow gateway, or without ledger.Config.KeepRequests.
-- Adding a nullable column without a default rewrites nothing.

-- +goose Up
ALTER TABLE llm_calls ADD COLUMN request bytea;

-- +goose Down
ALTER TABLE llm_calls DROP COLUMN request;
