-- onceflow schema, version 2: what the llm_calls ledger (llm/ledger), the tool-call keys
-- and onceflow gateway need beyond version 1's llm_calls table.

-- +goose Up

-- The work a row belongs to (job id and step, or the gateway's scope), kept readable for
-- people and audit; idem_key is a hash of it and of the request.
ALTER TABLE llm_calls ADD COLUMN work text NOT NULL DEFAULT '';
-- The attempt whose streamed output `partial` holds. A new attempt (a new generation,
-- since streams cannot resume) starts its own partial; the previous one stays readable
-- until the new one's first batch replaces it.
ALTER TABLE llm_calls ADD COLUMN partial_attempt integer;
-- What a byte-identical HTTP replay needs besides response_raw: the status and the
-- response headers worth replaying (onceflow gateway).
ALTER TABLE llm_calls ADD COLUMN response_meta jsonb;

-- The ledger of tool calls whose downstream effect was keyed: for one model request key,
-- the provider's tool-call id first seen for each call (identified by the tool name and
-- its canonical arguments). A repeated request whose same call comes back with another
-- id proves the provider's ids unstable, and still maps to the first key.
CREATE TABLE llm_tool_calls (
    request_key text        NOT NULL,
    args_key    text        NOT NULL,
    call_id     text        NOT NULL,
    tool        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (request_key, args_key)
);
CREATE INDEX llm_tool_calls_expires ON llm_tool_calls (expires_at);

-- +goose Down
DROP TABLE llm_tool_calls;
ALTER TABLE llm_calls DROP COLUMN response_meta;
ALTER TABLE llm_calls DROP COLUMN partial_attempt;
ALTER TABLE llm_calls DROP COLUMN work;
