-- onceflow schema, version 3: the completion record of every job that commits through
-- onceflow's Job.Commit, whatever its kind.

-- +goose Up

-- One row per finished job. The primary key is Job.Commit's first-writer-wins guard:
-- the completion is the first statement of the job's commit, so when two deliveries of
-- one job race, the second one's insert waits for the first and then fails (or, in
-- CommitTx, does nothing), and none of its rows or outbox effects are written. result
-- is what the job stored with Commit.Result, which JobState returns.
CREATE TABLE job_completions (
    job_id       text        PRIMARY KEY,
    kind         text        NOT NULL,
    tenant       text        NOT NULL DEFAULT '',
    result       jsonb,
    completed_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE job_completions;
