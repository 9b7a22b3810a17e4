-- onceflow schema, version 10: the model calls of a job, found by its id (the job's
-- events, EventsHandler). A call's work is "<escaped step>/<job id>"; the step is
-- escaped, so the job id is the second part.

-- +goose Up
-- Building the index holds the ledger's writes for as long as it takes (the table holds
-- Config.Ledger.Retention of calls, a day by default: seconds). Give up rather than
-- queue every model call behind a long transaction. With a very large ledger, create the
-- index first by hand with CREATE INDEX CONCURRENTLY (same name): this is then a no-op.
SET LOCAL lock_timeout = '5s';
CREATE INDEX IF NOT EXISTS llm_calls_job ON llm_calls (split_part(work, '/', 2));

-- +goose Down
DROP INDEX IF EXISTS llm_calls_job;
