-- onceflow schema, version 7: the tenant of each model call in the ledger, so that the
-- operator UI can list one tenant's calls. A job's calls get the job's tenant, the
-- gateway's the tenant of the credential; rows from before this version have ''.
-- Adding a column with a constant default rewrites nothing (PostgreSQL 11+).

-- +goose Up
-- The ALTER takes a brief ACCESS EXCLUSIVE lock: give up rather than queue every model
-- call behind a long transaction (run the migration again later).
SET LOCAL lock_timeout = '5s';
ALTER TABLE llm_calls ADD COLUMN tenant text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE llm_calls DROP COLUMN tenant;
