-- onceflow schema, version 12: an index of shadow_runs by time, for its purge
-- (Config.ShadowRetention) and the report's --since.

-- +goose Up
CREATE INDEX shadow_runs_created_at ON shadow_runs (created_at);

-- +goose Down
DROP INDEX shadow_runs_created_at;
