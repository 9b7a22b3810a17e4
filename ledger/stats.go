package ledger

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Stats counts the ledger's rows of one provider and model: what `onceflow audit`
// reports, so that the cost of a provider without server-side keys is measured from
// your own ambiguous-failure rate (docs/providers.md).
type Stats struct {
	Provider string `json:"provider"`
	Model    string `json:"model"`
	// Calls is the number of rows (distinct calls); InFlight, Succeeded and Failed
	// split it by state.
	Calls     int64 `json:"calls"`
	InFlight  int64 `json:"in_flight"`
	Succeeded int64 `json:"succeeded"`
	Failed    int64 `json:"failed"`
	// Abandoned counts in_flight rows nobody owns or whose owner's lease ran out: calls
	// whose last attempt ended ambiguously and that no retry has claimed (yet).
	Abandoned int64 `json:"abandoned"`
	// Attempts sums the rows' attempt numbers; Ambiguous the attempts that ended
	// without knowing whether the provider did the work (each possibly billed twice).
	Attempts  int64 `json:"attempts"`
	Ambiguous int64 `json:"ambiguous"`
}

// statsSQL counts llm_calls by provider and model (one scan; the audit runs rarely).
const statsSQL = `
SELECT provider, model, count(*),
	count(*) FILTER (WHERE state = 'in_flight'),
	count(*) FILTER (WHERE state = 'succeeded'),
	count(*) FILTER (WHERE state = 'failed'),
	count(*) FILTER (WHERE state = 'in_flight' AND (owner IS NULL OR lease_until < now())),
	coalesce(sum(attempt), 0), coalesce(sum(ambiguous), 0)
FROM llm_calls GROUP BY provider, model ORDER BY provider, model`

// ReadStats returns the ledger's counts per provider and model, from db (any onceflow
// database; no Ledger needed). Errors are database errors.
func ReadStats(ctx context.Context, db DB) ([]Stats, error) {
	rows, err := db.Query(ctx, statsSQL)
	if err != nil {
		return nil, fmt.Errorf("ledger: read stats: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Stats, error) {
		var s Stats
		err := r.Scan(&s.Provider, &s.Model, &s.Calls, &s.InFlight, &s.Succeeded, &s.Failed, &s.Abandoned, &s.Attempts, &s.Ambiguous)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: read stats: %w", err)
	}
	if out == nil {
		out = []Stats{}
	}
	return out, nil
}
