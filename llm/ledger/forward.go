// Package ledger is the former home of package ledger.
//
// Deprecated: package github.com/onceflow/onceflow/llm/ledger moved to github.com/onceflow/onceflow/ledger; this package forwards every name to it and will be removed in a later release.
package ledger

import (
	"context"

	ledgerpkg "github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
)

// Attempt is ledger.Attempt.
//
// Deprecated: use ledger.Attempt (package github.com/onceflow/onceflow/ledger).
type Attempt = ledgerpkg.Attempt

// Call is ledger.Call.
//
// Deprecated: use ledger.Call (package github.com/onceflow/onceflow/ledger).
type Call = ledgerpkg.Call

// Client is ledger.Client.
//
// Deprecated: use ledger.Client (package github.com/onceflow/onceflow/ledger).
type Client = ledgerpkg.Client

// Config is ledger.Config.
//
// Deprecated: use ledger.Config (package github.com/onceflow/onceflow/ledger).
type Config = ledgerpkg.Config

// DB is ledger.DB.
//
// Deprecated: use ledger.DB (package github.com/onceflow/onceflow/ledger).
type DB = ledgerpkg.DB

// DefaultLease is ledger.DefaultLease.
//
// Deprecated: use ledger.DefaultLease (package github.com/onceflow/onceflow/ledger).
const DefaultLease = ledgerpkg.DefaultLease

// DefaultPurgeBatch is ledger.DefaultPurgeBatch.
//
// Deprecated: use ledger.DefaultPurgeBatch (package github.com/onceflow/onceflow/ledger).
const DefaultPurgeBatch = ledgerpkg.DefaultPurgeBatch

// DefaultPurgeInterval is ledger.DefaultPurgeInterval.
//
// Deprecated: use ledger.DefaultPurgeInterval (package github.com/onceflow/onceflow/ledger).
const DefaultPurgeInterval = ledgerpkg.DefaultPurgeInterval

// DefaultRetention is ledger.DefaultRetention.
//
// Deprecated: use ledger.DefaultRetention (package github.com/onceflow/onceflow/ledger).
const DefaultRetention = ledgerpkg.DefaultRetention

// DefaultStreamFlushBytes is ledger.DefaultStreamFlushBytes.
//
// Deprecated: use ledger.DefaultStreamFlushBytes (package github.com/onceflow/onceflow/ledger).
const DefaultStreamFlushBytes = ledgerpkg.DefaultStreamFlushBytes

// DefaultStreamFlushInterval is ledger.DefaultStreamFlushInterval.
//
// Deprecated: use ledger.DefaultStreamFlushInterval (package github.com/onceflow/onceflow/ledger).
const DefaultStreamFlushInterval = ledgerpkg.DefaultStreamFlushInterval

// DefaultWait is ledger.DefaultWait.
//
// Deprecated: use ledger.DefaultWait (package github.com/onceflow/onceflow/ledger).
const DefaultWait = ledgerpkg.DefaultWait

// DefaultWriteTimeout is ledger.DefaultWriteTimeout.
//
// Deprecated: use ledger.DefaultWriteTimeout (package github.com/onceflow/onceflow/ledger).
const DefaultWriteTimeout = ledgerpkg.DefaultWriteTimeout

// ErrInFlight is ledger.ErrInFlight.
//
// Deprecated: use ledger.ErrInFlight (package github.com/onceflow/onceflow/ledger).
var ErrInFlight = ledgerpkg.ErrInFlight

// ErrKeyReused is ledger.ErrKeyReused.
//
// Deprecated: use ledger.ErrKeyReused (package github.com/onceflow/onceflow/ledger).
var ErrKeyReused = ledgerpkg.ErrKeyReused

// ErrNoWork is ledger.ErrNoWork.
//
// Deprecated: use ledger.ErrNoWork (package github.com/onceflow/onceflow/ledger).
var ErrNoWork = ledgerpkg.ErrNoWork

// ErrNotFound is ledger.ErrNotFound.
//
// Deprecated: use ledger.ErrNotFound (package github.com/onceflow/onceflow/ledger).
var ErrNotFound = ledgerpkg.ErrNotFound

// ErrPartialStopped is ledger.ErrPartialStopped.
//
// Deprecated: use ledger.ErrPartialStopped (package github.com/onceflow/onceflow/ledger).
var ErrPartialStopped = ledgerpkg.ErrPartialStopped

// ErrUnavailable is ledger.ErrUnavailable.
//
// Deprecated: use ledger.ErrUnavailable (package github.com/onceflow/onceflow/ledger).
var ErrUnavailable = ledgerpkg.ErrUnavailable

// HourStats is ledger.HourStats.
//
// Deprecated: use ledger.HourStats (package github.com/onceflow/onceflow/ledger).
type HourStats = ledgerpkg.HourStats

// InFlightError is ledger.InFlightError.
//
// Deprecated: use ledger.InFlightError (package github.com/onceflow/onceflow/ledger).
type InFlightError = ledgerpkg.InFlightError

// IsAmbiguous calls ledger.IsAmbiguous.
//
// Deprecated: use ledger.IsAmbiguous (package github.com/onceflow/onceflow/ledger).
func IsAmbiguous(err error) bool { return ledgerpkg.IsAmbiguous(err) }

// Key calls ledger.Key.
//
// Deprecated: use ledger.Key (package github.com/onceflow/onceflow/ledger).
func Key(work string, req *llm.Request) string { return ledgerpkg.Key(work, req) }

// KeyPrefix is ledger.KeyPrefix.
//
// Deprecated: use ledger.KeyPrefix (package github.com/onceflow/onceflow/ledger).
const KeyPrefix = ledgerpkg.KeyPrefix

// Ledger is ledger.Ledger.
//
// Deprecated: use ledger.Ledger (package github.com/onceflow/onceflow/ledger).
type Ledger = ledgerpkg.Ledger

// ListOptions is ledger.ListOptions.
//
// Deprecated: use ledger.ListOptions (package github.com/onceflow/onceflow/ledger).
type ListOptions = ledgerpkg.ListOptions

// New calls ledger.New.
//
// Deprecated: use ledger.New (package github.com/onceflow/onceflow/ledger).
func New(db ledgerpkg.DB, cfg ledgerpkg.Config) (*ledgerpkg.Ledger, error) {
	return ledgerpkg.New(db, cfg)
}

// PartialBuffer is ledger.PartialBuffer.
//
// Deprecated: use ledger.PartialBuffer (package github.com/onceflow/onceflow/ledger).
type PartialBuffer = ledgerpkg.PartialBuffer

// Progress is ledger.Progress.
//
// Deprecated: use ledger.Progress (package github.com/onceflow/onceflow/ledger).
type Progress = ledgerpkg.Progress

// ReadStats calls ledger.ReadStats.
//
// Deprecated: use ledger.ReadStats (package github.com/onceflow/onceflow/ledger).
func ReadStats(ctx context.Context, db ledgerpkg.DB) ([]ledgerpkg.Stats, error) {
	return ledgerpkg.ReadStats(ctx, db)
}

// Record is ledger.Record.
//
// Deprecated: use ledger.Record (package github.com/onceflow/onceflow/ledger).
type Record = ledgerpkg.Record

// RecordedToolCall is ledger.RecordedToolCall.
//
// Deprecated: use ledger.RecordedToolCall (package github.com/onceflow/onceflow/ledger).
type RecordedToolCall = ledgerpkg.RecordedToolCall

// RequestHash calls ledger.RequestHash.
//
// Deprecated: use ledger.RequestHash (package github.com/onceflow/onceflow/ledger).
func RequestHash(req *llm.Request) string { return ledgerpkg.RequestHash(req) }

// Result is ledger.Result.
//
// Deprecated: use ledger.Result (package github.com/onceflow/onceflow/ledger).
type Result = ledgerpkg.Result

// ResultOf calls ledger.ResultOf.
//
// Deprecated: use ledger.ResultOf (package github.com/onceflow/onceflow/ledger).
func ResultOf(resp *llm.Response) ledgerpkg.Result { return ledgerpkg.ResultOf(resp) }

// Row is ledger.Row.
//
// Deprecated: use ledger.Row (package github.com/onceflow/onceflow/ledger).
type Row = ledgerpkg.Row

// StateAmbiguous is ledger.StateAmbiguous.
//
// Deprecated: use ledger.StateAmbiguous (package github.com/onceflow/onceflow/ledger).
const StateAmbiguous = ledgerpkg.StateAmbiguous

// StateFailed is ledger.StateFailed.
//
// Deprecated: use ledger.StateFailed (package github.com/onceflow/onceflow/ledger).
const StateFailed = ledgerpkg.StateFailed

// StateInFlight is ledger.StateInFlight.
//
// Deprecated: use ledger.StateInFlight (package github.com/onceflow/onceflow/ledger).
const StateInFlight = ledgerpkg.StateInFlight

// StateSucceeded is ledger.StateSucceeded.
//
// Deprecated: use ledger.StateSucceeded (package github.com/onceflow/onceflow/ledger).
const StateSucceeded = ledgerpkg.StateSucceeded

// Stats is ledger.Stats.
//
// Deprecated: use ledger.Stats (package github.com/onceflow/onceflow/ledger).
type Stats = ledgerpkg.Stats

// Summary is ledger.Summary.
//
// Deprecated: use ledger.Summary (package github.com/onceflow/onceflow/ledger).
type Summary = ledgerpkg.Summary

// SupersededError is ledger.SupersededError.
//
// Deprecated: use ledger.SupersededError (package github.com/onceflow/onceflow/ledger).
type SupersededError = ledgerpkg.SupersededError

// ToolKey is ledger.ToolKey.
//
// Deprecated: use ledger.ToolKey (package github.com/onceflow/onceflow/ledger).
type ToolKey = ledgerpkg.ToolKey

// Work calls ledger.Work.
//
// Deprecated: use ledger.Work (package github.com/onceflow/onceflow/ledger).
func Work(jobID string, step string) string { return ledgerpkg.Work(jobID, step) }
