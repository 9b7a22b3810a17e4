// Package gateway is the former home of package gateway.
//
// Deprecated: package github.com/onceflow/onceflow/llm/gateway moved to github.com/onceflow/onceflow/gateway; this package forwards every name to it and will be removed in a later release.
package gateway

import (
	"net/http"

	gatewaypkg "github.com/onceflow/onceflow/gateway"
)

// Config is gateway.Config.
//
// Deprecated: use gateway.Config (package github.com/onceflow/onceflow/gateway).
type Config = gatewaypkg.Config

// CredentialScope calls gateway.CredentialScope.
//
// Deprecated: use gateway.CredentialScope (package github.com/onceflow/onceflow/gateway).
func CredentialScope(h http.Header, extra ...string) gatewaypkg.Scope {
	return gatewaypkg.CredentialScope(h, extra...)
}

// DefaultCredentialHeaders is gateway.DefaultCredentialHeaders.
//
// Deprecated: use gateway.DefaultCredentialHeaders (package github.com/onceflow/onceflow/gateway).
var DefaultCredentialHeaders = gatewaypkg.DefaultCredentialHeaders

// DefaultDeriveWindow is gateway.DefaultDeriveWindow.
//
// Deprecated: use gateway.DefaultDeriveWindow (package github.com/onceflow/onceflow/gateway).
const DefaultDeriveWindow = gatewaypkg.DefaultDeriveWindow

// DefaultMaxBodyBytes is gateway.DefaultMaxBodyBytes.
//
// Deprecated: use gateway.DefaultMaxBodyBytes (package github.com/onceflow/onceflow/gateway).
const DefaultMaxBodyBytes = gatewaypkg.DefaultMaxBodyBytes

// DefaultMaxIdleConns is gateway.DefaultMaxIdleConns.
//
// Deprecated: use gateway.DefaultMaxIdleConns (package github.com/onceflow/onceflow/gateway).
const DefaultMaxIdleConns = gatewaypkg.DefaultMaxIdleConns

// DefaultMaxResponseBytes is gateway.DefaultMaxResponseBytes.
//
// Deprecated: use gateway.DefaultMaxResponseBytes (package github.com/onceflow/onceflow/gateway).
const DefaultMaxResponseBytes = gatewaypkg.DefaultMaxResponseBytes

// DefaultRetryAfter is gateway.DefaultRetryAfter.
//
// Deprecated: use gateway.DefaultRetryAfter (package github.com/onceflow/onceflow/gateway).
const DefaultRetryAfter = gatewaypkg.DefaultRetryAfter

// DefaultTimeout is gateway.DefaultTimeout.
//
// Deprecated: use gateway.DefaultTimeout (package github.com/onceflow/onceflow/gateway).
const DefaultTimeout = gatewaypkg.DefaultTimeout

// DeriveRetryCount is gateway.DeriveRetryCount.
//
// Deprecated: use gateway.DeriveRetryCount (package github.com/onceflow/onceflow/gateway).
const DeriveRetryCount = gatewaypkg.DeriveRetryCount

// ErrNotMigrated is gateway.ErrNotMigrated.
//
// Deprecated: use gateway.ErrNotMigrated (package github.com/onceflow/onceflow/gateway).
var ErrNotMigrated = gatewaypkg.ErrNotMigrated

// Gateway is gateway.Gateway.
//
// Deprecated: use gateway.Gateway (package github.com/onceflow/onceflow/gateway).
type Gateway = gatewaypkg.Gateway

// HeaderJoined is gateway.HeaderJoined.
//
// Deprecated: use gateway.HeaderJoined (package github.com/onceflow/onceflow/gateway).
const HeaderJoined = gatewaypkg.HeaderJoined

// HeaderRestarted is gateway.HeaderRestarted.
//
// Deprecated: use gateway.HeaderRestarted (package github.com/onceflow/onceflow/gateway).
const HeaderRestarted = gatewaypkg.HeaderRestarted

// HeaderRetryCount is gateway.HeaderRetryCount.
//
// Deprecated: use gateway.HeaderRetryCount (package github.com/onceflow/onceflow/gateway).
const HeaderRetryCount = gatewaypkg.HeaderRetryCount

// KeyFor calls gateway.KeyFor.
//
// Deprecated: use gateway.KeyFor (package github.com/onceflow/onceflow/gateway).
func KeyFor(scope gatewaypkg.Scope, idempotencyKey string) string {
	return gatewaypkg.KeyFor(scope, idempotencyKey)
}

// New calls gateway.New.
//
// Deprecated: use gateway.New (package github.com/onceflow/onceflow/gateway).
func New(cfg gatewaypkg.Config) (*gatewaypkg.Gateway, error) { return gatewaypkg.New(cfg) }

// Provider is gateway.Provider.
//
// Deprecated: use gateway.Provider (package github.com/onceflow/onceflow/gateway).
const Provider = gatewaypkg.Provider

// Scope is gateway.Scope.
//
// Deprecated: use gateway.Scope (package github.com/onceflow/onceflow/gateway).
type Scope = gatewaypkg.Scope
