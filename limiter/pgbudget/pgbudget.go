// Package pgbudget keeps the tenants' own daily token budgets of package limiter in
// PostgreSQL, in the tenant_budgets table (onceflow's migrations create it): what
// `onceflow tenants set` writes and every worker's limiter reads (limiter.BudgetSource).
package pgbudget

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/queue"
)

// Store reads and writes tenant_budgets. It is safe for concurrent use.
type Store struct {
	db *pgxpool.Pool
}

var _ limiter.BudgetSource = (*Store)(nil)

// New returns a Store on db.
func New(db *pgxpool.Pool) *Store { return &Store{db: db} }

// Budget is one tenant's own budget.
type Budget struct {
	Tenant string `json:"tenant"`
	// TokensPerDay is the tenant's tokens per UTC day; 0 means no budget.
	TokensPerDay int64     `json:"tokens_per_day"`
	UpdatedAt    time.Time `json:"updated_at"`
}

// ErrInvalidTenant is matched by Set's error for a tenant name onceflow cannot use (up
// to 64 characters of A-Z a-z 0-9 . _ -, not empty).
var ErrInvalidTenant = errors.New("pgbudget: a tenant is 1 to 64 characters of A-Z a-z 0-9 . _ -")

// Set gives tenant tokensPerDay tokens per UTC day (0: no budget), replacing what it
// had. Workers apply it at their next refresh (limiter.Config.BudgetRefresh).
func (s *Store) Set(ctx context.Context, tenant string, tokensPerDay int64) error {
	if tenant == "" || !queue.ValidTenant(tenant) {
		return fmt.Errorf("%w: %q", ErrInvalidTenant, tenant)
	}
	if tokensPerDay < 0 {
		return fmt.Errorf("pgbudget: tokens per day %d must not be negative", tokensPerDay)
	}
	_, err := s.db.Exec(ctx, `INSERT INTO tenant_budgets (tenant, tokens_per_day) VALUES ($1, $2)
		ON CONFLICT (tenant) DO UPDATE SET tokens_per_day = EXCLUDED.tokens_per_day, updated_at = now()`, tenant, tokensPerDay)
	if err != nil {
		return fmt.Errorf("pgbudget: set the budget of %s: %w", tenant, err)
	}
	return nil
}

// Delete removes tenant's own budget: it has the default again. Deleting a tenant
// without one is not an error.
func (s *Store) Delete(ctx context.Context, tenant string) error {
	if _, err := s.db.Exec(ctx, `DELETE FROM tenant_budgets WHERE tenant = $1`, tenant); err != nil {
		return fmt.Errorf("pgbudget: delete the budget of %s: %w", tenant, err)
	}
	return nil
}

// List returns every tenant's own budget, by tenant.
func (s *Store) List(ctx context.Context) ([]Budget, error) {
	rows, err := s.db.Query(ctx, `SELECT tenant, tokens_per_day, updated_at FROM tenant_budgets ORDER BY tenant`)
	if err != nil {
		return nil, fmt.Errorf("pgbudget: list budgets: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Budget, error) {
		var b Budget
		err := r.Scan(&b.Tenant, &b.TokensPerDay, &b.UpdatedAt)
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("pgbudget: list budgets: %w", err)
	}
	return out, nil
}

// TokenBudgets implements limiter.BudgetSource.
func (s *Store) TokenBudgets(ctx context.Context) (map[string]int64, error) {
	list, err := s.List(ctx)
	if err != nil {
		return nil, err
	}
	m := make(map[string]int64, len(list))
	for _, b := range list {
		m[b.Tenant] = b.TokensPerDay
	}
	return m, nil
}
