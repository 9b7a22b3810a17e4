package testenv

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// schemaOf returns the search_path of dsn.
func schemaOf(t *testing.T, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return u.Query().Get("search_path")
}

// schemaExists reports whether schema is in the shared test database.
func schemaExists(t *testing.T, schema string) bool {
	t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	var ok bool
	if err := c.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", schema).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

func TestPooledSchemaIsMigratedAndEmptiedBetweenTests(t *testing.T) {
	ctx := context.Background()
	var schema string
	t.Run("writer", func(t *testing.T) {
		pool, dsn := Postgres(t)
		schema = schemaOf(t, dsn)
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('t', 'k1', '{}'), ('t', 'k2', '{}')`); err != nil {
			t.Fatalf("insert into a pooled schema (is it migrated?): %v", err)
		}
	})
	if !schemaExists(t, schema) {
		t.Fatalf("schema %s was dropped instead of handed back to the pool", schema)
	}
	// Claim schemas until the writer's comes back (other packages' tests may hold it).
	for range 20 {
		found := false
		t.Run("reader", func(t *testing.T) {
			pool, dsn := Postgres(t)
			if schemaOf(t, dsn) != schema {
				return
			}
			found = true
			var rows, id int64
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if rows != 0 {
				t.Fatalf("the next test found %d rows of the last one", rows)
			}
			err := pool.QueryRow(ctx, `INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('t', 'k1', '{}') RETURNING id`).Scan(&id)
			if err != nil {
				t.Fatal(err)
			}
			if id != 1 {
				t.Fatalf("first outbox id %d, want 1: sequences restart with the schema", id)
			}
			var versions int64
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM onceflow_migrations`).Scan(&versions); err != nil || versions == 0 {
				t.Fatalf("version table emptied (%d rows, %v): a later migrations.Up would apply everything again", versions, err)
			}
		})
		if found {
			return
		}
	}
	t.Skip("the writer's schema was never claimed again in 20 tries (held by other test processes)")
}

func TestPooledSchemaWithAChangedCatalogIsDropped(t *testing.T) {
	var schema string
	t.Run("alters", func(t *testing.T) {
		pool, dsn := Postgres(t)
		schema = schemaOf(t, dsn)
		if _, err := pool.Exec(context.Background(), `CREATE TABLE orders (id text PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
	})
	if schemaExists(t, schema) {
		t.Fatalf("schema %s with a table of a test's own went back to the pool", schema)
	}
}

// Changes to a pooled schema that add no table, column, constraint or index still change
// what the next test would meet: each drops the schema at cleanup instead of handing it
// back.
func TestPooledSchemaWithAChangedDefinitionIsDropped(t *testing.T) {
	for name, sql := range map[string]string{
		"a column default":       `ALTER TABLE outbox ALTER COLUMN attempts SET DEFAULT 7`,
		"a privilege":            `REVOKE INSERT ON outbox FROM CURRENT_USER`,
		"an identity's start":    `ALTER TABLE outbox ALTER COLUMN id SET START WITH 1000`,
		"a type":                 `CREATE TYPE mood AS ENUM ('ok')`,
		"row-level security":     `ALTER TABLE summaries ENABLE ROW LEVEL SECURITY`,
		"a function":             `CREATE FUNCTION pool_probe() RETURNS int LANGUAGE sql AS 'SELECT 1'`,
		"a table made unlogged":  `ALTER TABLE outbox SET UNLOGGED`,
		"a column's storage":     `ALTER TABLE outbox ALTER COLUMN topic SET STORAGE EXTERNAL`,
		"a table's storage knob": `ALTER TABLE outbox SET (fillfactor = 50)`,
	} {
		var schema string
		t.Run(name, func(t *testing.T) {
			pool, dsn := Postgres(t)
			schema = schemaOf(t, dsn)
			if _, err := pool.Exec(context.Background(), sql); err != nil {
				t.Fatal(err)
			}
		})
		if schemaExists(t, schema) {
			t.Errorf("schema %s went back to the pool after %s changed", schema, name)
		}
	}
}

func TestSchemasHeldAtOnceAreDistinct(t *testing.T) {
	seen := map[string]bool{}
	for range 4 {
		_, dsn := Postgres(t) // each claim lasts until the test ends
		s := schemaOf(t, dsn)
		if seen[s] {
			t.Fatalf("schema %s handed out twice while held", s)
		}
		seen[s] = true
	}
}

// privatePool is a pool of the test's own on the shared test database (a prefix no other
// test uses), with one migrated schema handed back clean, and that schema's name.
func privatePool(t *testing.T) (*pool, string) {
	t.Helper()
	ctx := context.Background()
	base := DatabaseURL(t)
	p := &pool{prefix: "pooltest" + randomHex(4) + "_"}
	t.Cleanup(func() {
		c, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close(ctx)
		rows, _ := c.Query(ctx, `SELECT nspname FROM pg_namespace WHERE nspname LIKE $1`, strings.ReplaceAll(p.prefix, "_", `\_`)+"%")
		names, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, n := range names {
			_, _ = c.Exec(ctx, "DROP SCHEMA "+n+" CASCADE")
		}
	})
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	s, err := p.claim(ctx, conn, base)
	if err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, fingerprintSQL, s).Scan(&p.fingerprint); err != nil {
		t.Fatal(err)
	}
	if err := p.release(ctx, conn, s); err != nil {
		t.Fatal(err)
	}
	return p, s
}

// claimAfter claims a schema of p on a connection of its own, with between run after
// the claim listed the pool's schemas and before it locks one.
func claimAfter(t *testing.T, p *pool, between func()) (string, *pgx.Conn, error) {
	t.Helper()
	ctx := context.Background()
	afterListing = between
	defer func() { afterListing = nil }()
	conn, err := pgx.Connect(ctx, DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	s, err := p.claim(ctx, conn, DatabaseURL(t))
	return s, conn, err
}

// A schema listed clean, then claimed by another test process that wrote rows and was
// killed before its cleanup, is emptied by the claim that locks it next: the listing is
// no proof of what the last holder left.
func TestClaimEmptiesASchemaDirtiedAfterTheListing(t *testing.T) {
	ctx := context.Background()
	p, schema := privatePool(t)
	s, conn, err := claimAfter(t, p, func() {
		other, err := pgx.Connect(ctx, DatabaseURL(t))
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close(ctx) // killed: the lock ends with its session
		if ok, err := tryLock(ctx, other, schema); err != nil || !ok {
			t.Fatalf("lock %s: %v %v", schema, ok, err)
		}
		if _, err := other.Exec(ctx, "COMMENT ON SCHEMA "+schema+" IS NULL; INSERT INTO "+schema+
			".outbox (topic, dedupe_key, payload) VALUES ('t', 'left-behind', '{}')"); err != nil {
			t.Fatal(err)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	var rows int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+s+".outbox").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 0 {
		t.Fatalf("claimed %s with %d rows of a killed test", s, rows)
	}
}

// A schema listed, then dropped by its holder's cleanup (its catalog had changed) before
// this claim locks it, is skipped: the claim takes or makes another.
func TestClaimSkipsASchemaDroppedAfterTheListing(t *testing.T) {
	ctx := context.Background()
	p, schema := privatePool(t)
	s, _, err := claimAfter(t, p, func() {
		other, err := pgx.Connect(ctx, DatabaseURL(t))
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close(ctx)
		if _, err := other.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Fatal(err)
		}
	})
	if err != nil {
		t.Fatalf("claim after a listed schema was dropped: %v", err)
	}
	if s == schema || !strings.HasPrefix(s, p.prefix) {
		t.Fatalf("claimed %s (the dropped one: %s)", s, schema)
	}
}

// A schema is locked from before it exists until it is migrated, by a claim that makes
// a new one and by a process's first migration alike: another process's claim or start,
// which drops the unlocked schemas a killed process left half migrated, passes it by.
func TestASchemaBeingMigratedIsLocked(t *testing.T) {
	ctx := context.Background()
	base := DatabaseURL(t)
	other, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	var seen []string
	whileMigrating = func(schema string) {
		seen = append(seen, schema)
		if ok, err := tryLock(ctx, other, schema); err != nil || ok {
			t.Errorf("schema %s being migrated could be locked by another session (%v): it is not held", schema, err)
			if ok {
				_ = unlock(ctx, other, schema)
			}
		}
	}
	defer func() { whileMigrating = nil }()
	privatePool(t) // a claim that finds no schema makes one
	p := &pool{}
	if err := p.init(ctx, base); err != nil { // a process's first migration
		t.Fatal(err)
	}
	if len(seen) != 2 {
		t.Fatalf("%d schemas migrated, want 2", len(seen))
	}
}

// A claim's connection is kept for the process's next claim, and its claim still ends
// at the test's cleanup: another process can lock the schema at once, and the next
// claim of this process gets the same connection without a lock or a setting of the last
// claim's.
func TestAnEndedClaimFreesItsSchemaAndItsConnectionServesTheNextClaim(t *testing.T) {
	ctx := context.Background()
	p, schema := privatePool(t)
	conn, err := p.connect(ctx, DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	got, err := p.claim(ctx, conn, DatabaseURL(t))
	if err != nil || got != schema {
		t.Fatalf("claim: %q %v, want the pool's one schema %q", got, err, schema)
	}
	if err := p.release(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	p.reuse(ctx, conn)

	other, err := pgx.Connect(ctx, DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close(ctx)
	if ok, err := tryLock(ctx, other, schema); err != nil || !ok {
		t.Fatalf("another process locks the handed-back schema: %v %v, want it free", ok, err)
	}
	if err := unlock(ctx, other, schema); err != nil {
		t.Fatal(err)
	}
	next, err := p.connect(ctx, DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close(ctx)
	if next != conn {
		t.Fatal("the next claim opened a new connection: the ended claim's was not kept")
	}
	var locks int
	if err := next.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&locks); err != nil || locks != 0 {
		t.Fatalf("the kept connection holds %d advisory locks (%v), want none", locks, err)
	}
	var lockTimeout string
	if err := next.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lockTimeout); err != nil || lockTimeout != "0" {
		t.Fatalf("the kept connection's lock_timeout is %q (%v): the last claim's session settings stayed", lockTimeout, err)
	}
}
