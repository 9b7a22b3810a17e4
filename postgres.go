package onceflow

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/retry"
)

// PostgresConfig parses a PostgreSQL URL (postgres://user:password@host:port/db?options,
// see pgxpool.ParseConfig) into a pool configuration with onceflow's defaults: at most
// DefaultPostgresMaxConns connections unless pool_max_conns is in the URL, a connect
// timeout of DefaultPostgresConnectTimeout unless connect_timeout is, and the sessions'
// statement_timeout (DefaultPostgresStatementTimeout) and
// idle_in_transaction_session_timeout unless the URL sets them. Errors do not show
// the password. Change the result (a ConnConfig.Tracer, AfterConnect, ...) as you need
// before pgxpool.NewWithConfig.
func PostgresConfig(url string) (*pgxpool.Config, error) { return connect.PostgresConfig(url) }

// NewPostgres returns a pool built from PostgresConfig(url). It connects lazily, so a
// program can start while PostgreSQL is down; ctx bounds nothing after it returns.
func NewPostgres(ctx context.Context, url string) (*pgxpool.Pool, error) {
	return connect.Postgres(ctx, url, nil)
}

// postgresUnreachableCodes are the SQLSTATEs (besides class 08, connection exception)
// with which PostgreSQL says it is going away or cannot take the session, not that a
// statement failed.
var postgresUnreachableCodes = map[string]bool{
	"57P01": true, // admin_shutdown: a fast or smart shutdown, pg_terminate_backend
	"57P02": true, // crash_shutdown: another backend crashed, the server restarts
	"57P03": true, // cannot_connect_now: starting up, shutting down, in recovery
	"53300": true, // too_many_connections: max_connections or a role's limit reached
}

// postgresUnreachable reports whether err says that PostgreSQL is unreachable or going
// away, rather than that a statement failed: a failed connection attempt
// (*pgconn.ConnectError, whatever its cause), a server error of SQLSTATE class 08 or one
// of postgresUnreachableCodes, an error pgx reports as safe to retry (nothing was sent:
// the connection was closed or broken before the write), a net.Error (a reset, a
// refused connection, a read timeout without a context deadline), or io.EOF and
// io.ErrUnexpectedEOF (the server closed the connection mid-exchange). Any other server
// error (a constraint, a syntax error, a serialization failure) is the statement's,
// and so is the end of the caller's context (context.Canceled, context.DeadlineExceeded:
// a shutdown, the job's budget), unless it ended a connection attempt.
//
// It is the one classifier of PostgreSQL outages for the database calls a job makes
// through onceflow (Job.Commit, Job.CommitTx, the ledger of Job.Complete and Job.Stream).
func postgresUnreachable(err error) bool {
	if err == nil {
		return false
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "08") || postgresUnreachableCodes[pgErr.Code]
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// PostgresError returns err marked Unavailable (errors.Is ErrUnavailable) when it says
// PostgreSQL is unreachable or going away, rather than that a statement failed: a failed
// connection attempt, a lost or closed connection, a server shutting down, starting up
// or out of connections. Any other error, nil, and an error already marked Unavailable
// or Permanent are returned as they are. A Worker that reads or writes its own tables
// through Client.DB returns its errors through it, as Commit, CommitTx and the model
// ledger do, so that a database outage hands the job back without spending a delivery
// while a failing statement still does.
func PostgresError(err error) error {
	if err == nil || retry.IsPermanent(err) || errors.Is(err, ErrUnavailable) || !postgresUnreachable(err) {
		return err
	}
	return Unavailable(err)
}
