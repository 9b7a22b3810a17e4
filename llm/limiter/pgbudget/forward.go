// Package pgbudget is the former home of package pgbudget.
//
// Deprecated: package github.com/onceflow/onceflow/llm/limiter/pgbudget moved to github.com/onceflow/onceflow/limiter/pgbudget; this package forwards every name to it and will be removed in a later release.
package pgbudget

import (
	"github.com/jackc/pgx/v5/pgxpool"
	pgbudgetpkg "github.com/onceflow/onceflow/limiter/pgbudget"
)

// Budget is pgbudget.Budget.
//
// Deprecated: use pgbudget.Budget (package github.com/onceflow/onceflow/limiter/pgbudget).
type Budget = pgbudgetpkg.Budget

// ErrInvalidTenant is pgbudget.ErrInvalidTenant.
//
// Deprecated: use pgbudget.ErrInvalidTenant (package github.com/onceflow/onceflow/limiter/pgbudget).
var ErrInvalidTenant = pgbudgetpkg.ErrInvalidTenant

// New calls pgbudget.New.
//
// Deprecated: use pgbudget.New (package github.com/onceflow/onceflow/limiter/pgbudget).
func New(db *pgxpool.Pool) *pgbudgetpkg.Store { return pgbudgetpkg.New(db) }

// Store is pgbudget.Store.
//
// Deprecated: use pgbudget.Store (package github.com/onceflow/onceflow/limiter/pgbudget).
type Store = pgbudgetpkg.Store
