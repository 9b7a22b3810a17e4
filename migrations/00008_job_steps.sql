-- onceflow schema, version 8: the recorded steps of jobs (onceflow.Do, Job.Tool and
-- Job.ToolAtMostOnce). A step's first successful result is recorded here and returned to
-- every later delivery of its job instead of running the step again.

-- +goose Up

-- One row per recorded step of a job. name is the step's name (Do) or "tool:" and the
-- tool call's content-addressed key (Job.Tool). state 'done' holds the result; state
-- 'intent' (Job.ToolAtMostOnce) says the tool was started and its result never
-- recorded: the job is in doubt until an operator resolves it. tool and arguments
-- describe a tool call for the operator. expires_at bounds the row's life (the purge
-- deletes it after every delivery of its job is over: Config.StepRetention).
CREATE TABLE job_steps (
    tenant     text        NOT NULL DEFAULT '',
    job_id     text        NOT NULL,
    name       text        NOT NULL,
    state      text        NOT NULL CHECK (state IN ('intent', 'done')),
    result     bytea,
    tool       text        NOT NULL DEFAULT '',
    arguments  text        NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, job_id, name)
);

-- The purge's scan, and the operators' list of jobs in doubt.
CREATE INDEX job_steps_expires_at ON job_steps (expires_at);
CREATE INDEX job_steps_intent ON job_steps (created_at) WHERE state = 'intent';

-- +goose Down
DROP TABLE job_steps;
