package pgbudget_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter/pgbudget"
)

func TestSetListDeleteRoundTrip(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	s := pgbudget.New(pool)
	ctx := context.Background()

	if list, err := s.List(ctx); err != nil || len(list) != 0 {
		t.Fatalf("List of an empty table: %v %v", list, err)
	}
	if m, err := s.TokenBudgets(ctx); err != nil || m == nil || len(m) != 0 {
		t.Fatalf("TokenBudgets of an empty table: %v %v; want an empty map", m, err)
	}

	max64 := strings.Repeat("x", 64)
	for tenant, n := range map[string]int64{"zeta": 100, "acme": 5, "free.tier_1-A": 0, max64: 1 << 62} {
		if err := s.Set(ctx, tenant, n); err != nil {
			t.Fatalf("Set(%s, %d): %v", tenant, n, err)
		}
	}
	first, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond) // now() of the next transaction is later
	if err := s.Set(ctx, "acme", 7); err != nil {
		t.Fatalf("Set replacing a budget: %v", err)
	}
	list, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, b := range list {
		got = append(got, fmt.Sprintf("%s=%d", b.Tenant, b.TokensPerDay))
		if b.UpdatedAt.IsZero() || time.Since(b.UpdatedAt) > time.Minute {
			t.Errorf("%s: UpdatedAt %v", b.Tenant, b.UpdatedAt)
		}
	}
	if want := []string{"acme=7", "free.tier_1-A=0", max64 + "=4611686018427387904", "zeta=100"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("List = %v, want %v (by tenant)", got, want)
	}
	if !list[0].UpdatedAt.After(first[0].UpdatedAt) || !list[3].UpdatedAt.Equal(first[3].UpdatedAt) {
		t.Errorf("UpdatedAt of acme %v -> %v, of zeta %v -> %v: a Set moves its own tenant's only",
			first[0].UpdatedAt, list[0].UpdatedAt, first[3].UpdatedAt, list[3].UpdatedAt)
	}

	m, err := s.TokenBudgets(ctx)
	if want := map[string]int64{"acme": 7, "free.tier_1-A": 0, max64: 1 << 62, "zeta": 100}; err != nil || !maps.Equal(m, want) {
		t.Errorf("TokenBudgets = %v %v, want %v", m, err, want)
	}

	if err := s.Delete(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "acme"); err != nil {
		t.Errorf("Delete of a tenant without a budget: %v, want nil", err)
	}
	if err := s.Delete(ctx, "never-set"); err != nil {
		t.Errorf("Delete of a tenant never set: %v, want nil", err)
	}
	m, err = s.TokenBudgets(ctx)
	if _, ok := m["acme"]; err != nil || ok || len(m) != 3 {
		t.Errorf("TokenBudgets after Delete(acme) = %v %v", m, err)
	}
}

// Set refuses what the table's CHECKs would, before any SQL: a Store on a closed pool
// still answers with the validation's error.
func TestSetRefusesBadInputBeforeSQL(t *testing.T) {
	t.Parallel()
	pool, err := connect.Postgres(context.Background(), testenv.DatabaseURL(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	pool.Close()
	s := pgbudget.New(pool)
	ctx := context.Background()
	for _, tenant := range []string{"", "a b", "a:b", "a/b", "{acme}", "é", strings.Repeat("a", 65), "acme\n"} {
		if err := s.Set(ctx, tenant, 1); !errors.Is(err, pgbudget.ErrInvalidTenant) {
			t.Errorf("Set(%q) = %v, want ErrInvalidTenant", tenant, err)
		}
	}
	for _, n := range []int64{-1, -1 << 63} {
		err := s.Set(ctx, "acme", n)
		if err == nil || errors.Is(err, pgbudget.ErrInvalidTenant) || !strings.Contains(err.Error(), "must not be negative") {
			t.Errorf("Set(acme, %d) = %v, want a negative-budget error", n, err)
		}
	}
	if err := s.Set(ctx, "acme", 1); err == nil || !strings.Contains(err.Error(), "set the budget of acme") {
		t.Errorf("Set on a closed pool = %v: a valid budget must reach the pool", err)
	}
}

// The table refuses by itself what Set refuses (writers that bypass the Store).
func TestTableChecks(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	for _, c := range []struct {
		tenant string
		n      int64
	}{{"a b", 1}, {"", 1}, {strings.Repeat("a", 65), 1}, {"a:b", 1}, {"acme", -1}} {
		_, err := pool.Exec(ctx, `INSERT INTO tenant_budgets (tenant, tokens_per_day) VALUES ($1, $2)`, c.tenant, c.n)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "23514" { // check_violation
			t.Errorf("INSERT (%q, %d): %v, want a check violation", c.tenant, c.n, err)
		}
	}
	if _, err := pool.Exec(ctx, `INSERT INTO tenant_budgets (tenant, tokens_per_day) VALUES ($1, 0)`, strings.Repeat("a", 64)); err != nil {
		t.Errorf("INSERT of a valid row: %v", err)
	}
}

func TestConcurrentSetsOfOneTenant(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Postgres(t)
	s := pgbudget.New(pool)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- s.Set(ctx, "acme", int64(i+1))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("concurrent Set: %v", err)
		}
	}
	m, err := s.TokenBudgets(ctx)
	if err != nil || len(m) != 1 || m["acme"] < 1 || m["acme"] > 16 {
		t.Errorf("after 16 concurrent Sets: %v %v, want one row with one of the values", m, err)
	}
}
