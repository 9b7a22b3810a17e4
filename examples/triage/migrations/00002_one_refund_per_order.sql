-- One refund per order: two tickets about the same order (two keys, two jobs) must not
-- refund it twice. The unique index is the guard when two such jobs commit at once;
-- the worker reads it first to answer the second ticket that the order was refunded.

-- +goose Up
ALTER TABLE refunds ADD COLUMN tenant text NOT NULL DEFAULT '';
CREATE UNIQUE INDEX refunds_one_per_order ON refunds (tenant, order_id);

-- +goose Down
DROP INDEX refunds_one_per_order;
ALTER TABLE refunds DROP COLUMN tenant;
