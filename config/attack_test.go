package config

import (
	"log/slog"
	"strings"
	"testing"
)

// The README promises that passwords and tokens in URLs are redacted wherever
// configuration is logged. pgx (like libpq) takes the password as a query parameter of
// the connection URI (postgres://u@db/x?password=...), and an upstream may take its key
// in the query (ONCEFLOW_LLM_BASE_URL=...?key=...); both are printed in clear by the
// "starting ..." line every command logs, and the gateway's "upstream" attribute.
func TestAttackPasswordInAURLQueryIsNotLogged(t *testing.T) {
	c, err := load(t, map[string]string{
		"ONCEFLOW_DATABASE_URL": "postgres://onceflow@db:5432/onceflow?password=pg-query-secret&sslmode=disable",
		"ONCEFLOW_LLM_BASE_URL": "https://llm.example.com/v1?key=llm-query-secret",
	})
	if err != nil {
		t.Fatal(err)
	}
	var logged strings.Builder
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("starting work", "config", c)
	outs := map[string]string{"config": c.String() + logged.String(),
		"RedactURL (the gateway's upstream attribute)": RedactURL(c.LLMBaseURL)}
	for what, out := range outs {
		for _, s := range []string{"pg-query-secret", "llm-query-secret"} {
			if strings.Contains(out, s) {
				t.Errorf("%s prints %q", what, s)
			}
		}
	}
}
