package testenv

import (
	"context"
	"net/url"
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
