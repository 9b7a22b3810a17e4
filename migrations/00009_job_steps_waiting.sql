-- onceflow schema, version 9: a recorded step may be a wait (onceflow.WaitSignal,
-- onceflow.Sleep, a tool call's approval): state 'waiting', with the wait's deadline and
-- what the operator needs to decide in result.

-- +goose Up
SET LOCAL lock_timeout = '5s';
ALTER TABLE job_steps DROP CONSTRAINT job_steps_state_check;
ALTER TABLE job_steps ADD CONSTRAINT job_steps_state_check CHECK (state IN ('intent', 'done', 'waiting'));
-- The operators' list of pending approvals.
CREATE INDEX job_steps_waiting ON job_steps (created_at) WHERE state = 'waiting';

-- +goose Down
DROP INDEX job_steps_waiting;
DELETE FROM job_steps WHERE state = 'waiting';
ALTER TABLE job_steps DROP CONSTRAINT job_steps_state_check;
ALTER TABLE job_steps ADD CONSTRAINT job_steps_state_check CHECK (state IN ('intent', 'done'));
