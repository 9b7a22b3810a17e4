-- onceflow schema, version 5: tenants' own daily token budgets for the model limiter
-- (onceflow tenants set TENANT --tokens-per-day N). A tenant without a row has
-- ONCEFLOW_TENANT_TOKEN_BUDGET; a row with 0 means no budget for that tenant.

-- +goose Up
CREATE TABLE tenant_budgets (
    tenant         text PRIMARY KEY CHECK (tenant ~ '^[A-Za-z0-9._-]{1,64}$'),
    tokens_per_day bigint NOT NULL CHECK (tokens_per_day >= 0),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE tenant_budgets;
