-- The tables of the test workflow "notes" (cli's hosting tests and example).

-- +goose Up
CREATE TABLE notes (
    job_id text PRIMARY KEY,
    tenant text NOT NULL,
    body   text NOT NULL
);

-- +goose Down
DROP TABLE notes;
