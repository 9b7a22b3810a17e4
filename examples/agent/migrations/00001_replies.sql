-- The agent workflow's own table, written by its worker in the Job.Commit that emits the
-- reply email: one row per support request, the reply its customer gets.

-- +goose Up
CREATE TABLE replies (
    job_id     text        PRIMARY KEY,
    tenant     text        NOT NULL,
    order_id   text        NOT NULL,
    to_addr    text        NOT NULL,
    body       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE replies;
