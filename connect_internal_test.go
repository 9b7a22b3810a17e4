package onceflow

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// redisUnreachable tells Redis's outages from failing commands, on errors produced by a
// real server: stopped, turned into a replica (READONLY, MASTERDOWN), out of memory
// (OOM), killing the client's connection, and commands that fail on their own account.
func TestRedisUnreachableClassifiesRealErrors(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv := testenv.PrivateRedis(t)
	open := func() *redis.Client {
		t.Helper()
		rdb, err := NewRedis(testenv.RedisURLOf(srv))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rdb.Close() })
		return rdb
	}
	rdb, admin := open(), open()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	var rows outageRows
	add := func(name string, err error, want bool) { t.Helper(); rows.add(t, name, err, want) }
	keys := queue.Keys{Prefix: "t", Queue: "q"}
	enqueue := func(c *redis.Client) error {
		_, err := queue.Enqueue(ctx, c, keys, queue.Message{JobID: "j", Kind: "k", Payload: []byte(`{}`), EnqueuedAt: time.Now()})
		return err
	}

	// Commands that fail on their own account.
	must(rdb.Set(ctx, "str", "x", 0).Err())
	add("wrong type", rdb.LPush(ctx, "str", "x").Err(), false)
	add("script error", rdb.Eval(ctx, `return redis.error_reply('boom')`, nil).Err(), false)
	add("unknown command", rdb.Do(ctx, "NOSUCHCOMMAND").Err(), false)
	add("no script", rdb.EvalSha(ctx, "0000000000000000000000000000000000000000", nil).Err(), false)
	done, stop := context.WithCancel(ctx)
	stop()
	add("the caller's cancel", rdb.Ping(done).Err(), false)
	closed := open()
	must(closed.Close())
	add("a closed client", closed.Ping(ctx).Err(), false)

	// Redis cannot take writes: a replica of a master that is down, out of memory.
	must(admin.Do(ctx, "REPLICAOF", "127.0.0.1", testenv.FreePort(t)).Err())
	add("READONLY", enqueue(rdb), true)
	must(admin.ConfigSet(ctx, "replica-serve-stale-data", "no").Err())
	add("MASTERDOWN", rdb.Get(ctx, "str").Err(), true)
	must(admin.ConfigSet(ctx, "replica-serve-stale-data", "yes").Err())
	must(admin.Do(ctx, "REPLICAOF", "NO", "ONE").Err())
	must(admin.ConfigSet(ctx, "maxmemory", "1").Err())
	add("OOM", enqueue(rdb), true)
	must(admin.ConfigSet(ctx, "maxmemory", "0").Err())

	// The server drops the connection, then stops.
	blocked := make(chan error, 1)
	go func() { blocked <- rdb.BLPop(ctx, 30*time.Second, "nothing").Err() }()
	testenv.WaitFor(t, 10*time.Second, "the blocked client", func() bool {
		n, err := admin.Info(ctx, "clients").Result()
		return err == nil && strings.Contains(n, "blocked_clients:1")
	})
	must(admin.ClientKillByFilter(ctx, "TYPE", "normal", "SKIPME", "yes").Err())
	add("connection killed mid-command", <-blocked, true)
	srv.Stop()
	add("server stopped, pooled connection", enqueue(admin), true)
	add("server stopped, new connection", enqueue(open()), true)
	add("server stopped, keyed accept", func() error {
		c, err := NewClient(Config{Redis: open(), Prefix: "t", Logger: testenv.Logger(t)})
		must(err)
		_, err = c.Enqueue(ctx, sortArgs{}, &EnqueueOpts{Key: "key-1"})
		return err
	}(), true)
	srv.Start()

	rows.check(t, "redisUnreachable", redisUnreachable)
	if redisUnreachable(nil) {
		t.Error("nil is an outage")
	}
}

// sortArgs is a job kind for the tests of this package.
type sortArgs struct{}

func (sortArgs) Kind() string { return "sort" }

// postgresUnreachable tells PostgreSQL's outages from failing statements, on errors
// produced by a real server: one stopped, one restarted under an open connection, one
// that terminates a session, and statements that fail on their own account. Only the
// SQLSTATEs no test can cheaply provoke are built by hand.
func TestPostgresUnreachableClassifiesRealErrors(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg, url, _ := testenv.MigratedPrivatePostgres(t, "&connect_timeout=2")
	conn := func() *pgx.Conn {
		t.Helper()
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	exec := func(c *pgx.Conn, sql string) error {
		_, err := c.Exec(ctx, sql)
		return err
	}
	var rows outageRows
	add := func(name string, err error, want bool) { t.Helper(); rows.add(t, name, err, want) }

	// Failing statements, on a live server: the job's own failures.
	live := conn()
	if err := exec(live, `CREATE TABLE t (id int PRIMARY KEY CHECK (id > 0))`); err != nil {
		t.Fatal(err)
	}
	if err := exec(live, `INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	add("unique violation", exec(live, `INSERT INTO t VALUES (1)`), false)
	add("check violation", exec(live, `INSERT INTO t VALUES (-1)`), false)
	add("syntax error", exec(live, `INSERT INTO`), false)
	add("undefined table", exec(live, `SELECT * FROM no_such_table`), false)
	add("division by zero", exec(live, `SELECT 1/0`), false)
	add("statement timeout", exec(live, `SET statement_timeout = '10ms'; SELECT pg_sleep(1)`), false)
	if err := exec(live, `SET statement_timeout = 0`); err != nil {
		t.Fatal(err)
	}
	short, stop := context.WithTimeout(ctx, 20*time.Millisecond)
	_, err := conn().Exec(short, `SELECT pg_sleep(1)`) // pgx closes a connection its context interrupts
	stop()
	add("the caller's deadline", err, false)
	done, stop := context.WithCancel(ctx)
	stop()
	_, err = conn().Exec(done, `SELECT 1`)
	add("the caller's cancel", err, false)

	// A session the server terminates (pg_terminate_backend): admin_shutdown, then a
	// closed connection.
	victim := conn()
	if err := exec(live, fmt.Sprintf(`SELECT pg_terminate_backend(%d)`, victim.PgConn().PID())); err != nil {
		t.Fatal(err)
	}
	add("terminated session", exec(victim, `SELECT 1`), true)
	add("terminated session, used again", exec(victim, `SELECT 1`), true)

	// The server stops under open connections, a pool and the ledger.
	open := conn()
	pool, err := connect.Postgres(ctx, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := ledger.New(pool, ledger.Config{})
	if err != nil {
		t.Fatal(err)
	}
	pg.Stop()
	add("open connection, server stopped", exec(open, `SELECT 1`), true)
	add("open connection, used again", exec(open, `SELECT 1`), true)
	_, err = pool.Exec(ctx, `SELECT 1`)
	add("pool, server stopped", err, true)
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO t VALUES (2)`)
	add("pool batch, server stopped", pool.SendBatch(ctx, b).Close(), true)
	_, err = pool.Begin(ctx)
	add("pool begin, server stopped", err, true)
	_, err = pgx.Connect(ctx, url)
	add("connect refused", err, true)
	_, err = l.Get(ctx, "some-key")
	add("ledger, server stopped", err, true)
	ledgerDown := err
	pg.Start()

	// SQLSTATEs no test here can cheaply provoke, as pgx reports them.
	for code, want := range map[string]bool{
		"08006": true, "08003": true, "57P02": true, "57P03": true, "53300": true,
		"53100": false, "40001": false, "23505": false, "57014": false,
	} {
		add("SQLSTATE "+code, fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code}), want)
	}

	rows.check(t, "postgresUnreachable", postgresUnreachable)
	for _, r := range rows {
		marked := PostgresError(r.err)
		if errors.Is(marked, ErrUnavailable) != r.want || !errors.Is(marked, r.err) {
			t.Errorf("%s: PostgresError(%v) = %v: Unavailable %v, want %v, still wrapping the error", r.name, r.err, marked, errors.Is(marked, ErrUnavailable), r.want)
		}
	}
	// A model step whose ledger calls failed while PostgreSQL was down (retry.Do gave
	// up on them) is handed back, not spent.
	for _, err := range []error{&retry.ExhaustedError{Attempts: 3, Err: ledgerDown},
		&retry.DeadlineExceededError{Attempts: 2, Err: ledgerDown}} {
		if got := modelError("summarise", err); !errors.Is(got, ErrUnavailable) || !errors.Is(got, ledger.ErrUnavailable) {
			t.Errorf("model step on a stopped PostgreSQL: %v, want it Unavailable", got)
		}
	}
	if postgresUnreachable(nil) || PostgresError(nil) != nil {
		t.Error("nil is an outage")
	}
	perm := Permanent(fmt.Errorf("commit: %w", &pgconn.PgError{Code: "08006"}))
	if got := PostgresError(perm); got != perm {
		t.Errorf("a permanent error was marked again: %v", got)
	}
	una := Unavailable(&pgconn.PgError{Code: "08006"})
	if got := PostgresError(una); got != una {
		t.Errorf("an Unavailable error was marked twice: %v", got)
	}
}

// outageRow is a real error and whether a classifier must call it an outage.
type outageRow struct {
	name string
	err  error
	want bool
}

// outageRows are the rows a classifier is checked against.
type outageRows []outageRow

// add appends err, which must not be nil.
func (rows *outageRows) add(t *testing.T, name string, err error, want bool) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error", name)
	}
	*rows = append(*rows, outageRow{name, err, want})
}

// check fails the test for each row that classify, named name, gets wrong.
func (rows outageRows) check(t *testing.T, name string, classify func(error) bool) {
	t.Helper()
	for _, r := range rows {
		t.Logf("%s: %T: %v", r.name, r.err, r.err)
		if got := classify(r.err); got != r.want {
			t.Errorf("%s: %s(%T %v) = %v, want %v", r.name, name, r.err, r.err, got, r.want)
		}
	}
}
