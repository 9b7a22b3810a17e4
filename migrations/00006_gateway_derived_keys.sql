-- onceflow schema, version 6: the keys onceflow gateway derives for requests without an
-- Idempotency-Key (ONCEFLOW_GATEWAY_DERIVE_KEYS=retry-count). A request an official SDK
-- sends for the first time (X-Stainless-Retry-Count: 0) gets a fresh llm_calls key,
-- noted here under the fingerprint of its credentials and canonical body; a retry of it
-- (X-Stainless-Retry-Count >= 1, same fingerprint, within ONCEFLOW_GATEWAY_DERIVE_WINDOW)
-- is answered from that call: joined while in flight, replayed once recorded.

-- +goose Up
CREATE TABLE gateway_derived_keys (
    -- hex SHA-256 of the credential scope and the request's fingerprint
    fingerprint text PRIMARY KEY,
    -- the llm_calls key of the latest first attempt with this fingerprint
    idem_key    text NOT NULL,
    seen_at     timestamptz NOT NULL DEFAULT now()
);
-- Purging rows older than the window.
CREATE INDEX gateway_derived_keys_seen ON gateway_derived_keys (seen_at);

-- +goose Down
DROP TABLE gateway_derived_keys;
