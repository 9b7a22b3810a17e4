-- onceflow schema, version 11: shadow runs, a candidate's answer beside production's
-- (Config.Shadows).

-- +goose Up

-- One row per production model call and candidate: the shadow job commits it with its
-- completion, once (the primary key), whatever crashes and redeliveries came between.
-- prod_key is the production call's ledger key (llm_calls.idem_key); the answers are
-- llm.Response as JSON; agree, score and detail are the comparison's; latencies in
-- milliseconds as the deliveries measured them (a call replayed from the ledger after a
-- crash measures its replay); costs by the limiter's price table (0 for an unknown
-- model).
CREATE TABLE shadow_runs (
    prod_key           text             NOT NULL,
    candidate          text             NOT NULL,
    tenant             text             NOT NULL DEFAULT '',
    job_id             text             NOT NULL,
    kind               text             NOT NULL DEFAULT '',
    step               text             NOT NULL,
    prod_model         text             NOT NULL DEFAULT '',
    cand_model         text             NOT NULL DEFAULT '',
    prod_answer        jsonb            NOT NULL,
    cand_answer        jsonb            NOT NULL,
    agree              boolean          NOT NULL,
    score              double precision NOT NULL,
    detail             text             NOT NULL DEFAULT '',
    prod_latency_ms    bigint           NOT NULL DEFAULT 0,
    cand_latency_ms    bigint           NOT NULL DEFAULT 0,
    prod_input_tokens  integer          NOT NULL DEFAULT 0,
    prod_output_tokens integer          NOT NULL DEFAULT 0,
    cand_input_tokens  integer          NOT NULL DEFAULT 0,
    cand_output_tokens integer          NOT NULL DEFAULT 0,
    prod_cost_usd      double precision NOT NULL DEFAULT 0,
    cand_cost_usd      double precision NOT NULL DEFAULT 0,
    created_at         timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (prod_key, candidate)
);

CREATE INDEX shadow_runs_step_created ON shadow_runs (step, created_at);

-- +goose Down
DROP TABLE shadow_runs;
