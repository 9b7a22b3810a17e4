-- +goose Up
-- A user's own table, next to onceflow's: it may refer to them.
CREATE TABLE refunds (
    job_id       text    PRIMARY KEY REFERENCES job_completions (job_id),
    order_id     text    NOT NULL,
    amount_cents integer NOT NULL
);

-- +goose Down
DROP TABLE refunds;
