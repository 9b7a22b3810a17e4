package testenv

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/migrations"
)

// The schema pool: Postgres hands each test a schema that onceflow's migrations were
// applied to once, instead of migrating a fresh one per test (River's riverdbtest does
// the same). A pooled schema is named pool_<fingerprint>_<random>, where the fingerprint
// digests the catalog the migrations leave (fingerprintSQL), so a changed migration gets
// schemas of its own. A test claims one with a session advisory lock held on a
// connection of its own until its cleanup (which then releases the lock and keeps the
// connection for the process's next claim), which empties every table (DELETE, the version
// table excepted, and its sequences restarted) and hands it back only if its catalog
// still has the fingerprint: a test that created, dropped or altered a table, a default,
// a privilege, a type... has its schema dropped instead. The lock dies with a killed test process, so a schema
// is never claimed twice and never lost; one whose process was killed before its cleanup
// is emptied by the next test that claims it.

// poolLockSpace is the first key of the pool's advisory locks (two int4 keys: a space of
// its own, apart from the migrations' one-bigint locks).
const poolLockSpace = 0x0f10

// fingerprintSQL digests the catalog of schema $1, with the schema's name taken out of
// every definition so that two schemas migrated alike digest alike: its relations (kind,
// persistence, options, privileges, row-level security) and their columns (type, not
// null, default, identity, generation, storage), constraints, indexes, functions (with
// their arguments and bodies), triggers (with whether they fire), policies, sequences'
// parameters and types. A test that changed any of them leaves a schema whose
// fingerprint differs, and it is dropped rather than handed back.
const fingerprintSQL = `
SELECT md5(coalesce(string_agg(x, E'\n' ORDER BY x), '')) FROM (
  SELECT 'rel ' || c.relname || ' ' || c.relkind::text || ' ' || c.relpersistence::text || ' ' ||
    coalesce(c.reloptions::text, '') || ' ' || coalesce(c.relacl::text, '') || ' ' ||
    c.relrowsecurity || c.relforcerowsecurity || ' ' || coalesce((
    SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || ' ' || a.attnotnull || ' ' ||
      a.attidentity::text || a.attgenerated::text || a.attstorage::text || ' ' ||
      coalesce(replace(pg_get_expr(d.adbin, d.adrelid), $1 || '.', ''), ''), ', ' ORDER BY a.attnum)
    FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '') AS x
  FROM pg_class c WHERE c.relnamespace = $1::regnamespace
  UNION ALL
  SELECT 'seq ' || c.relname || ' ' || s.seqstart || ' ' || s.seqincrement || ' ' || s.seqmin || ' ' || s.seqmax || ' ' || s.seqcycle
  FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid WHERE c.relnamespace = $1::regnamespace
  UNION ALL
  SELECT 'con ' || conname || ' ' || replace(pg_get_constraintdef(oid), $1 || '.', '')
  FROM pg_constraint WHERE connamespace = $1::regnamespace
  UNION ALL
  SELECT 'idx ' || replace(pg_get_indexdef(i.indexrelid), $1 || '.', '')
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relnamespace = $1::regnamespace
  UNION ALL
  SELECT 'fn ' || proname || '(' || pg_get_function_identity_arguments(oid) || ') ' || md5(coalesce(prosrc, ''))
  FROM pg_proc WHERE pronamespace = $1::regnamespace
  UNION ALL
  SELECT 'trg ' || replace(pg_get_triggerdef(t.oid), $1 || '.', '') || ' ' || t.tgenabled::text
  FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
  WHERE c.relnamespace = $1::regnamespace AND NOT t.tgisinternal
  UNION ALL
  SELECT 'pol ' || c.relname || ' ' || p.polname
  FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid WHERE c.relnamespace = $1::regnamespace
  UNION ALL
  SELECT 'typ ' || t.typname || ' ' || t.typtype::text
  FROM pg_type t WHERE t.typnamespace = $1::regnamespace AND t.typrelid = 0 AND t.typelem = 0
) s`

// emptySQL empties every table of the schema named by the setting onceflow.pool_schema
// but the version table, and restarts its sequences, in one round trip. DELETE, not
// TRUNCATE: a test leaves a few rows, and TRUNCATE's new files cost ten times more.
const emptySQL = `
DO $$
DECLARE
  s text := current_setting('onceflow.pool_schema');
  r record;
BEGIN
  FOR r IN SELECT tablename FROM pg_tables
           WHERE schemaname = s AND tablename <> current_setting('onceflow.pool_version_table') LOOP
    EXECUTE format('DELETE FROM %I.%I', s, r.tablename);
  END LOOP;
  FOR r IN SELECT sequencename, start_value FROM pg_sequences WHERE schemaname = s LOOP
    PERFORM setval(format('%I.%I', s, r.sequencename)::regclass, r.start_value, false);
  END LOOP;
END $$`

// cleanMark is the comment of a pooled schema that its last test handed back emptied and
// unchanged; a claim removes it, so a schema whose test was killed is checked and
// emptied by the next claim.
const cleanMark = "onceflow test pool: clean"

// pool is the process's view of the schema pool of one database.
type pool struct {
	once        sync.Once
	err         error
	fingerprint string // of a freshly migrated schema
	prefix      string // pool_<fingerprint[:12]>_

	// idle holds the connections of claims that ended, for the next claims of this
	// process: a new backend per test, with catalog caches to warm before the claim's
	// first catalog query, cost more PostgreSQL CPU than the claim itself.
	mu   sync.Mutex
	idle []*pgx.Conn
}

// maxIdleClaimConns bounds the connections a process keeps for its next claims (about
// the tests it runs at once).
const maxIdleClaimConns = 16

// connect returns an idle claim connection of this process, or a new one.
func (p *pool) connect(ctx context.Context, base string) (*pgx.Conn, error) {
	p.mu.Lock()
	for len(p.idle) > 0 {
		c := p.idle[len(p.idle)-1]
		p.idle = p.idle[:len(p.idle)-1]
		if !c.IsClosed() {
			p.mu.Unlock()
			return c, nil
		}
	}
	p.mu.Unlock()
	return pgx.Connect(ctx, base)
}

// reuse hands conn, whose claim ended, to the next claim: with every advisory lock it
// holds released (the claim ends here, as it would with the connection) and its
// session's settings reset (lock_timeout...), or closed when that fails, when it is in
// a transaction, or when enough are idle.
func (p *pool) reuse(ctx context.Context, conn *pgx.Conn) {
	if conn.PgConn().TxStatus() == 'I' {
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock_all(); RESET ALL"); err == nil {
			p.mu.Lock()
			if len(p.idle) < maxIdleClaimConns {
				p.idle = append(p.idle, conn)
				conn = nil
			}
			p.mu.Unlock()
		}
	}
	if conn != nil {
		_ = conn.Close(ctx)
	}
}

var pools sync.Map // database URL -> *pool

// afterListing, when set (by this package's tests), runs after a claim listed the pool's
// schemas and before it locks one.
var afterListing func()

// whileMigrating, when set (by this package's tests), runs after a new schema is created
// and before it is migrated, with its name.
var whileMigrating func(schema string)

// pooledSchema claims a migrated schema of the pool on base (the shared test
// PostgreSQL), empty, for t: it returns the schema's name; the claim ends at t's
// cleanup, which empties the schema for the next test (or drops it, see above).
func pooledSchema(t testing.TB, base string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pv, _ := pools.LoadOrStore(base, &pool{})
	p := pv.(*pool)
	p.once.Do(func() { p.err = p.init(ctx, base) })
	if p.err != nil {
		t.Fatalf("schema pool: %v", p.err)
	}
	conn, err := p.connect(ctx, base)
	if err != nil {
		t.Fatalf("postgres: %v", err)
	}
	schema, err := p.claim(ctx, conn, base)
	if err != nil {
		_ = conn.Close(ctx)
		t.Fatalf("schema pool: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := p.release(ctx, conn, schema); err != nil {
			_ = conn.Close(ctx) // ends the claim
			t.Errorf("schema pool: hand back %s: %v", schema, err)
			return
		}
		p.reuse(ctx, conn) // ends the claim
	})
	return schema
}

// init migrates one schema to learn the fingerprint of the migrations, keeps it as the
// pool's first schema, and drops the unclaimed schemas of other fingerprints (pools of
// earlier migrations).
func (p *pool) init(ctx context.Context, base string) error {
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	fresh := "poolnew_" + randomHex(6)
	// Held while it is migrated, so that another process's init, which drops the
	// half-migrated schemas killed processes left, passes it by.
	if locked, err := tryLock(ctx, conn, fresh); err != nil || !locked {
		return fmt.Errorf("lock the new schema %s: %v (held: %v)", fresh, err, !locked)
	}
	defer func() { _ = unlock(ctx, conn, fresh) }()
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+fresh); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	if whileMigrating != nil {
		whileMigrating(fresh)
	}
	if err := migrate(ctx, base, fresh); err != nil {
		_, _ = conn.Exec(ctx, "DROP SCHEMA "+fresh+" CASCADE")
		return err
	}
	if err := conn.QueryRow(ctx, fingerprintSQL, fresh).Scan(&p.fingerprint); err != nil {
		return fmt.Errorf("fingerprint: %w", err)
	}
	p.prefix = "pool_" + p.fingerprint[:12] + "_"
	if _, err := conn.Exec(ctx, "ALTER SCHEMA "+fresh+" RENAME TO "+p.prefix+randomHex(6)); err != nil {
		return fmt.Errorf("rename schema: %w", err)
	}
	// Schemas of other fingerprints, and migrations a killed process left half done.
	rows, err := conn.Query(ctx, `SELECT nspname FROM pg_namespace
		WHERE (nspname LIKE 'pool\_%' OR nspname LIKE 'poolnew\_%') AND nspname NOT LIKE $1`, p.prefix+"%")
	if err != nil {
		return fmt.Errorf("list pooled schemas: %w", err)
	}
	stale, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("list pooled schemas: %w", err)
	}
	for _, s := range stale {
		if locked, err := tryLock(ctx, conn, s); err != nil || !locked {
			continue // claimed by a process of another checkout or commit
		}
		_, _ = conn.Exec(ctx, "SET lock_timeout = '2s'; DROP SCHEMA IF EXISTS "+s+" CASCADE")
		_ = unlock(ctx, conn, s)
	}
	return nil
}

// claim takes the first pooled schema no one holds, emptying it if the process that held
// it last died before its cleanup, or migrates a new one when all are taken.
func (p *pool) claim(ctx context.Context, conn *pgx.Conn, base string) (string, error) {
	type pooled struct {
		Name  string
		Clean bool
	}
	rows, err := conn.Query(ctx, `SELECT nspname, coalesce(obj_description(oid, 'pg_namespace') = $2, false)
		FROM pg_namespace WHERE nspname LIKE $1 ORDER BY random()`,
		strings.ReplaceAll(p.prefix, "_", `\_`)+"%", cleanMark)
	if err != nil {
		return "", fmt.Errorf("list pooled schemas: %w", err)
	}
	list, err := pgx.CollectRows(rows, pgx.RowToStructByPos[pooled])
	if err != nil {
		return "", fmt.Errorf("list pooled schemas: %w", err)
	}
	if afterListing != nil {
		afterListing()
	}
	for _, ps := range list {
		s := ps.Name
		locked, err := tryLock(ctx, conn, s)
		if err != nil {
			return "", err
		}
		if !locked {
			continue
		}
		// The listing is no proof of what the last holder left: since then another test
		// may have claimed the schema and been killed (not clean), or dropped it at its
		// cleanup (its catalog changed). Read both again under the lock.
		err = conn.QueryRow(ctx, `SELECT coalesce(obj_description(oid, 'pg_namespace') = $2, false)
			FROM pg_namespace WHERE nspname = $1`, s, cleanMark).Scan(&ps.Clean)
		if errors.Is(err, pgx.ErrNoRows) {
			_ = unlock(ctx, conn, s)
			continue
		}
		if err != nil {
			return "", fmt.Errorf("claim schema %s: %w", s, err)
		}
		if _, err := conn.Exec(ctx, "COMMENT ON SCHEMA "+s+" IS NULL"); err != nil {
			return "", fmt.Errorf("claim schema %s: %w", s, err)
		}
		if ps.Clean {
			return s, nil
		}
		// Not handed back clean (its test process was killed): check it is still what the
		// migrations make, and empty it.
		var fp string
		err = conn.QueryRow(ctx, fingerprintSQL, s).Scan(&fp)
		if err == nil && fp == p.fingerprint {
			if err = empty(ctx, conn, s); err == nil {
				return s, nil
			}
		}
		_, _ = conn.Exec(ctx, "SET lock_timeout = '2s'; DROP SCHEMA IF EXISTS "+s+" CASCADE")
		_ = unlock(ctx, conn, s)
	}
	s := p.prefix + randomHex(6)
	// Locked before it exists: a claim in another process that lists it while it is
	// migrated must not take it for a schema a killed process left, and drop it.
	if locked, err := tryLock(ctx, conn, s); err != nil || !locked {
		return "", fmt.Errorf("lock the new schema %s: %v (held: %v)", s, err, !locked)
	}
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+s); err != nil {
		return "", fmt.Errorf("create schema: %w", err)
	}
	if whileMigrating != nil {
		whileMigrating(s)
	}
	if err := migrate(ctx, base, s); err != nil {
		_, _ = conn.Exec(ctx, "DROP SCHEMA "+s+" CASCADE")
		return "", err
	}
	return s, nil
}

// release empties schema for the next test, or drops it when its catalog is no longer
// the migrations' (or it cannot be emptied: a lock held by a process the test started).
func (p *pool) release(ctx context.Context, conn *pgx.Conn, schema string) error {
	var fp string
	err := conn.QueryRow(ctx, fingerprintSQL, schema).Scan(&fp)
	if err == nil && fp == p.fingerprint {
		if err = empty(ctx, conn, schema); err == nil {
			if _, err = conn.Exec(ctx, "COMMENT ON SCHEMA "+schema+" IS '"+cleanMark+"'"); err == nil {
				return nil
			}
		}
	}
	if _, err := conn.Exec(ctx, "SET lock_timeout = 0; DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema: %w", err)
	}
	return nil
}

// empty empties every table of schema but the version table and restarts its sequences.
func empty(ctx context.Context, conn *pgx.Conn, schema string) error {
	batch := &pgx.Batch{}
	batch.Queue("SELECT set_config('lock_timeout', '5s', false), set_config('onceflow.pool_schema', $1, false), set_config('onceflow.pool_version_table', $2, false)",
		schema, migrations.VersionTable)
	batch.Queue(emptySQL)
	if err := conn.SendBatch(ctx, batch).Close(); err != nil {
		return fmt.Errorf("empty schema: %w", err)
	}
	return nil
}

// migrate applies onceflow's migrations to schema.
func migrate(ctx context.Context, base, schema string) error {
	dsn, err := withSearchPath(base, schema)
	if err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, dsn, discardLogger()); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}

func tryLock(ctx context.Context, conn *pgx.Conn, schema string) (bool, error) {
	var ok bool
	err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1, hashtext($2))", poolLockSpace, schema).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("lock schema %s: %w", schema, err)
	}
	return ok, nil
}

func unlock(ctx context.Context, conn *pgx.Conn, schema string) error {
	_, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1, hashtext($2))", poolLockSpace, schema)
	return err
}
