-- The triage workflow's own tables, written by its worker in one Job.Commit: the
-- ticket's triage, the refund its model call decided (if any) and the reply email.

-- +goose Up
CREATE TABLE tickets (
    job_id     text        PRIMARY KEY,
    tenant     text        NOT NULL,
    customer   text        NOT NULL,
    order_id   text        NOT NULL,
    category   text        NOT NULL CHECK (category IN ('refund', 'question')),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE refunds (
    refund_key   text    PRIMARY KEY, -- the tool-call key, the payments API's Idempotency-Key
    job_id       text    NOT NULL REFERENCES tickets (job_id),
    order_id     text    NOT NULL,
    amount_cents integer NOT NULL CHECK (amount_cents > 0)
);

CREATE TABLE replies (
    job_id  text PRIMARY KEY REFERENCES tickets (job_id),
    to_addr text NOT NULL,
    body    text NOT NULL
);

-- +goose Down
DROP TABLE replies;
DROP TABLE refunds;
DROP TABLE tickets;
