-- onceflow schema, version 7: when a derived key's call was answered. An SDK retries a
-- request within seconds of its failed attempt (its longest backoff is 8 s, a
-- Retry-After at most 60 s), so a note whose call was answered more than a minute ago
-- is no longer offered to retries: a later identical request whose first attempt never
-- reached the gateway gets a call of its own rather than that old answer.

-- +goose Up
ALTER TABLE gateway_derived_keys ADD COLUMN answered_at timestamptz;

-- +goose Down
ALTER TABLE gateway_derived_keys DROP COLUMN answered_at;
