package gateway_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
)

// Ready fails on a database nobody migrated, naming the migration, and holds on a
// migrated one (`onceflow gateway` serves it as /readyz's "ledger" check).
func TestReadyNamesAMissingMigration(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	empty, err := connect.Postgres(ctx, testenv.EmptySchema(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(empty.Close)
	migrated, _ := testenv.Postgres(t)
	for _, tc := range []struct {
		name string
		cfg  gateway.Config
		want error
	}{
		{"unmigrated", gateway.Config{DB: empty}, gateway.ErrNotMigrated},
		{"unmigrated, derived keys", gateway.Config{DB: empty, DeriveKeys: "retry-count"}, gateway.ErrNotMigrated},
		{"migrated", gateway.Config{DB: migrated}, nil},
		{"migrated, derived keys", gateway.Config{DB: migrated, DeriveKeys: "retry-count"}, nil},
	} {
		tc.cfg.Upstream, tc.cfg.Logger = "http://127.0.0.1:1/v1", testenv.Logger(t)
		g, err := gateway.New(tc.cfg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if err := g.Ready(ctx); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("%s: Ready = %v, want %v", tc.name, err, tc.want)
		}
	}
}
