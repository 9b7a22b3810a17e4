-- +goose Up
CREATE TABLE replies (
    job_id text PRIMARY KEY,
    body   text NOT NULL
);

-- +goose Down
DROP TABLE replies;
