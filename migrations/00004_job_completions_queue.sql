-- onceflow schema, version 4: the queue a completed job ran on, so that JobState of a
-- done job names it as it does for a queued, running or failed one.

-- +goose Up
ALTER TABLE job_completions ADD COLUMN queue text NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE job_completions DROP COLUMN queue;
