// Package limiter is the former home of package limiter.
//
// Deprecated: package github.com/onceflow/onceflow/llm/limiter moved to github.com/onceflow/onceflow/limiter; this package forwards every name to it and will be removed in a later release.
package limiter

import (
	"context"

	limiterpkg "github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	redis "github.com/redis/go-redis/v9"
)

// BudgetSource is limiter.BudgetSource.
//
// Deprecated: use limiter.BudgetSource (package github.com/onceflow/onceflow/limiter).
type BudgetSource = limiterpkg.BudgetSource

// Call is limiter.Call.
//
// Deprecated: use limiter.Call (package github.com/onceflow/onceflow/limiter).
type Call = limiterpkg.Call

// CallFor calls limiter.CallFor.
//
// Deprecated: use limiter.CallFor (package github.com/onceflow/onceflow/limiter).
func CallFor(tenant string, req *llm.Request) limiterpkg.Call { return limiterpkg.CallFor(tenant, req) }

// Config is limiter.Config.
//
// Deprecated: use limiter.Config (package github.com/onceflow/onceflow/limiter).
type Config = limiterpkg.Config

// DefaultBudgetRefresh is limiter.DefaultBudgetRefresh.
//
// Deprecated: use limiter.DefaultBudgetRefresh (package github.com/onceflow/onceflow/limiter).
const DefaultBudgetRefresh = limiterpkg.DefaultBudgetRefresh

// DefaultHalfLife is limiter.DefaultHalfLife.
//
// Deprecated: use limiter.DefaultHalfLife (package github.com/onceflow/onceflow/limiter).
const DefaultHalfLife = limiterpkg.DefaultHalfLife

// DefaultLease is limiter.DefaultLease.
//
// Deprecated: use limiter.DefaultLease (package github.com/onceflow/onceflow/limiter).
const DefaultLease = limiterpkg.DefaultLease

// DefaultMaxPause is limiter.DefaultMaxPause.
//
// Deprecated: use limiter.DefaultMaxPause (package github.com/onceflow/onceflow/limiter).
const DefaultMaxPause = limiterpkg.DefaultMaxPause

// DefaultMaxWait is limiter.DefaultMaxWait.
//
// Deprecated: use limiter.DefaultMaxWait (package github.com/onceflow/onceflow/limiter).
const DefaultMaxWait = limiterpkg.DefaultMaxWait

// DefaultModel is limiter.DefaultModel.
//
// Deprecated: use limiter.DefaultModel (package github.com/onceflow/onceflow/limiter).
const DefaultModel = limiterpkg.DefaultModel

// DefaultPrices is limiter.DefaultPrices.
//
// Deprecated: use limiter.DefaultPrices (package github.com/onceflow/onceflow/limiter).
var DefaultPrices = limiterpkg.DefaultPrices

// DefaultProvider is limiter.DefaultProvider.
//
// Deprecated: use limiter.DefaultProvider (package github.com/onceflow/onceflow/limiter).
const DefaultProvider = limiterpkg.DefaultProvider

// DefaultQuotaPause is limiter.DefaultQuotaPause.
//
// Deprecated: use limiter.DefaultQuotaPause (package github.com/onceflow/onceflow/limiter).
const DefaultQuotaPause = limiterpkg.DefaultQuotaPause

// DefaultRateLimitPause is limiter.DefaultRateLimitPause.
//
// Deprecated: use limiter.DefaultRateLimitPause (package github.com/onceflow/onceflow/limiter).
const DefaultRateLimitPause = limiterpkg.DefaultRateLimitPause

// DefaultSyncInterval is limiter.DefaultSyncInterval.
//
// Deprecated: use limiter.DefaultSyncInterval (package github.com/onceflow/onceflow/limiter).
const DefaultSyncInterval = limiterpkg.DefaultSyncInterval

// ErrQuotaPaused is limiter.ErrQuotaPaused.
//
// Deprecated: use limiter.ErrQuotaPaused (package github.com/onceflow/onceflow/limiter).
var ErrQuotaPaused = limiterpkg.ErrQuotaPaused

// ErrTooLarge is limiter.ErrTooLarge.
//
// Deprecated: use limiter.ErrTooLarge (package github.com/onceflow/onceflow/limiter).
var ErrTooLarge = limiterpkg.ErrTooLarge

// Keys is limiter.Keys.
//
// Deprecated: use limiter.Keys (package github.com/onceflow/onceflow/limiter).
type Keys = limiterpkg.Keys

// Limiter is limiter.Limiter.
//
// Deprecated: use limiter.Limiter (package github.com/onceflow/onceflow/limiter).
type Limiter = limiterpkg.Limiter

// Limits is limiter.Limits.
//
// Deprecated: use limiter.Limits (package github.com/onceflow/onceflow/limiter).
type Limits = limiterpkg.Limits

// ModelState is limiter.ModelState.
//
// Deprecated: use limiter.ModelState (package github.com/onceflow/onceflow/limiter).
type ModelState = limiterpkg.ModelState

// ModelUsage is limiter.ModelUsage.
//
// Deprecated: use limiter.ModelUsage (package github.com/onceflow/onceflow/limiter).
type ModelUsage = limiterpkg.ModelUsage

// New calls limiter.New.
//
// Deprecated: use limiter.New (package github.com/onceflow/onceflow/limiter).
func New(rdb redis.UniversalClient, cfg limiterpkg.Config) (*limiterpkg.Limiter, error) {
	return limiterpkg.New(rdb, cfg)
}

// NoTenant is limiter.NoTenant.
//
// Deprecated: use limiter.NoTenant (package github.com/onceflow/onceflow/limiter).
const NoTenant = limiterpkg.NoTenant

// ParseModelLimits calls limiter.ParseModelLimits.
//
// Deprecated: use limiter.ParseModelLimits (package github.com/onceflow/onceflow/limiter).
func ParseModelLimits(s string) (map[string]limiterpkg.Limits, error) {
	return limiterpkg.ParseModelLimits(s)
}

// ParsePrices calls limiter.ParsePrices.
//
// Deprecated: use limiter.ParsePrices (package github.com/onceflow/onceflow/limiter).
func ParsePrices(s string) (map[string]limiterpkg.Price, error) { return limiterpkg.ParsePrices(s) }

// Permit is limiter.Permit.
//
// Deprecated: use limiter.Permit (package github.com/onceflow/onceflow/limiter).
type Permit = limiterpkg.Permit

// Price is limiter.Price.
//
// Deprecated: use limiter.Price (package github.com/onceflow/onceflow/limiter).
type Price = limiterpkg.Price

// Result is limiter.Result.
//
// Deprecated: use limiter.Result (package github.com/onceflow/onceflow/limiter).
type Result = limiterpkg.Result

// TenantFrom calls limiter.TenantFrom.
//
// Deprecated: use limiter.TenantFrom (package github.com/onceflow/onceflow/limiter).
func TenantFrom(ctx context.Context) string { return limiterpkg.TenantFrom(ctx) }

// TenantUsage is limiter.TenantUsage.
//
// Deprecated: use limiter.TenantUsage (package github.com/onceflow/onceflow/limiter).
type TenantUsage = limiterpkg.TenantUsage

// WithTenant calls limiter.WithTenant.
//
// Deprecated: use limiter.WithTenant (package github.com/onceflow/onceflow/limiter).
func WithTenant(ctx context.Context, tenant string) context.Context {
	return limiterpkg.WithTenant(ctx, tenant)
}
