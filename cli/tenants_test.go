package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/limiter/pgbudget"
	"github.com/onceflow/onceflow/llm"
)

// tenantsEnv is the environment of the tenants tests: the test Redis under a prefix of
// their own, a migrated schema of their own, a default budget of 1000 tokens a day and
// a price of gpt-4.1-mini of their own (1 and 2 dollars per million tokens).
func tenantsEnv(t *testing.T) (getenv func(string) string, rdb *redis.Client, prefix string, pool *pgxpool.Pool) {
	t.Helper()
	rdb, prefix = testenv.Redis(t)
	pool, dsn := testenv.Postgres(t)
	vars := map[string]string{
		"ONCEFLOW_REDIS_URL":           testenv.RedisURL(t),
		"ONCEFLOW_DATABASE_URL":        dsn,
		"ONCEFLOW_PREFIX":              prefix,
		"ONCEFLOW_TENANT_TOKEN_BUDGET": "1000",
		"ONCEFLOW_LLM_PRICES":          "gpt-4.1-mini input=1 output=2",
		"ONCEFLOW_LOG_FORMAT":          "text",
	}
	return func(k string) string { return vars[k] }, rdb, prefix, pool
}

// tenants runs `onceflow tenants args...` to its end.
func tenants(t *testing.T, getenv func(string) string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errs bytes.Buffer
	err := cli.Run(context.Background(), cli.App{}, append([]string{"tenants"}, args...), &out, &errs, getenv)
	return out.String(), errs.String(), cli.ExitCode(err)
}

// listedTenant is a row of `tenants list --json`.
type listedTenant struct {
	Tenant          string    `json:"tenant"`
	TokensPerDay    int64     `json:"tokens_per_day"`
	Source          string    `json:"source"`
	UsedTokens      int64     `json:"used_tokens"`
	ReservedTokens  int64     `json:"reserved_tokens"`
	RemainingTokens *int64    `json:"remaining_tokens"`
	Calls           int64     `json:"calls"`
	InputTokens     int64     `json:"input_tokens"`
	OutputTokens    int64     `json:"output_tokens"`
	CostUSD         float64   `json:"cost_usd"`
	BudgetUpdatedAt time.Time `json:"budget_updated_at"`
}

// listJSON runs `tenants list --json`, checks the document's shape and returns its
// tenants by name.
func listJSON(t *testing.T, getenv func(string) string) map[string]listedTenant {
	t.Helper()
	out, errOut, code := tenants(t, getenv, "list", "--json")
	if code != 0 {
		t.Fatalf("tenants list --json: exit %d: %s", code, errOut)
	}
	var raw struct {
		Day                 string           `json:"day"`
		DefaultTokensPerDay *int64           `json:"default_tokens_per_day"`
		Tenants             []map[string]any `json:"tenants"`
	}
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatalf("tenants list --json printed %q: %v", out, err)
	}
	if today := time.Now().UTC().Format(time.DateOnly); raw.Day != today || raw.DefaultTokensPerDay == nil || *raw.DefaultTokensPerDay != 1000 {
		t.Errorf("tenants list --json: day %q, default %v; want %s and 1000 (ONCEFLOW_TENANT_TOKEN_BUDGET)", raw.Day, raw.DefaultTokensPerDay, today)
	}
	if raw.Tenants == nil {
		t.Fatalf("tenants list --json: no tenants array in %s", out)
	}
	byName := map[string]listedTenant{}
	for _, m := range raw.Tenants {
		for _, f := range []string{"tenant", "tokens_per_day", "source", "used_tokens", "reserved_tokens", "remaining_tokens",
			"calls", "input_tokens", "output_tokens", "cost_usd"} {
			if _, ok := m[f]; !ok {
				t.Errorf("tenants list --json: a tenant without %q: %v", f, m)
			}
		}
		b, _ := json.Marshal(m)
		var r listedTenant
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatalf("tenant %s: %v", b, err)
		}
		byName[r.Tenant] = r
	}
	return byName
}

// tableRow returns the fields of tenant's row in the `tenants list` table.
func tableRow(t *testing.T, getenv func(string) string, tenant string) []string {
	t.Helper()
	out, errOut, code := tenants(t, getenv, "list")
	if code != 0 {
		t.Fatalf("tenants list: exit %d: %s", code, errOut)
	}
	lines := strings.Split(out, "\n")
	if h := strings.Fields(lines[0]); strings.Join(h, " ") != "TENANT TOKENS/DAY BUDGET USED RESERVED REMAINING CALLS COST_USD" {
		t.Errorf("tenants list header %q", lines[0])
	}
	for _, l := range lines[1:] {
		if f := strings.Fields(l); len(f) > 0 && f[0] == tenant {
			return f
		}
	}
	t.Fatalf("tenants list has no row of %s:\n%s", tenant, out)
	return nil
}

func TestTenantsSetListDelete(t *testing.T) {
	t.Parallel()
	getenv, _, _, pool := tenantsEnv(t)

	if out, errOut, code := tenants(t, getenv, "list"); code != 0 || !strings.Contains(out, "no tenant has its own budget") ||
		!strings.Contains(out, "1000 tokens per day") {
		t.Fatalf("list with no tenant: exit %d, %q %s", code, out, errOut)
	}
	// Flags after the tenant and before it.
	if out, errOut, code := tenants(t, getenv, "set", "acme", "--tokens-per-day", "50000"); code != 0 || out != "tenant acme: 50000 tokens per day (its own budget); workers apply it within 30s\n" {
		t.Fatalf("set acme: exit %d, %q %s", code, out, errOut)
	}
	if out, errOut, code := tenants(t, getenv, "set", "--tokens-per-day=0", "free.tier_1"); code != 0 || out != "tenant free.tier_1: unlimited (its own setting: no token budget); workers apply it within 30s\n" {
		t.Fatalf("set free.tier_1 0: exit %d, %q %s", code, out, errOut)
	}
	own, err := pgbudget.New(pool).TokenBudgets(context.Background())
	if err != nil || len(own) != 2 || own["acme"] != 50000 || own["free.tier_1"] != 0 {
		t.Fatalf("tenant_budgets after two sets: %v %v", own, err)
	}

	if f := tableRow(t, getenv, "acme"); strings.Join(f, " ") != "acme 50000 own 0 0 50000 0 0.000000" {
		t.Errorf("acme's row: %q", f)
	}
	if f := tableRow(t, getenv, "free.tier_1"); strings.Join(f, " ") != "free.tier_1 unlimited own 0 0 - 0 0.000000" {
		t.Errorf("free.tier_1's row: %q", f)
	}
	listed := listJSON(t, getenv)
	acme, free := listed["acme"], listed["free.tier_1"]
	if len(listed) != 2 || acme.TokensPerDay != 50000 || acme.Source != "own" || acme.RemainingTokens == nil || *acme.RemainingTokens != 50000 ||
		acme.UsedTokens != 0 || acme.Calls != 0 || time.Since(acme.BudgetUpdatedAt) > time.Minute {
		t.Errorf("list --json: %+v", listed)
	}
	if free.TokensPerDay != 0 || free.Source != "own" || free.RemainingTokens != nil {
		t.Errorf("list --json: a tenant with its own budget 0 is unlimited, remaining null: %+v", free)
	}

	// Set again replaces; delete brings the default back (and a tenant without calls
	// and without a budget of its own is not listed).
	if _, errOut, code := tenants(t, getenv, "set", "acme", "--tokens-per-day", "7"); code != 0 {
		t.Fatalf("set acme 7: exit %d: %s", code, errOut)
	}
	if got := listJSON(t, getenv)["acme"]; got.TokensPerDay != 7 || got.Source != "own" {
		t.Errorf("after set acme 7: %+v", got)
	}
	if out, errOut, code := tenants(t, getenv, "delete", "acme"); code != 0 || !strings.Contains(out, "tenant acme: the default budget, 1000 tokens per day") {
		t.Fatalf("delete acme: exit %d, %q %s", code, out, errOut)
	}
	if _, _, code := tenants(t, getenv, "delete", "acme"); code != 0 {
		t.Errorf("deleting a tenant without its own budget: exit %d, want 0", code)
	}
	listed = listJSON(t, getenv)
	if _, ok := listed["acme"]; ok || len(listed) != 1 {
		t.Errorf("after delete acme: %+v", listed)
	}
}

func TestTenantsUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	getenv, _, _, pool := tenantsEnv(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"set", "bad tenant!", "--tokens-per-day", "5"}, `invalid tenant "bad tenant!"`},
		{[]string{"set", strings.Repeat("a", 65), "--tokens-per-day", "5"}, "invalid tenant"},
		{[]string{"set", "a:b", "--tokens-per-day", "5"}, "1 to 64 characters of A-Z a-z 0-9 . _ -"},
		{[]string{"set", "", "--tokens-per-day", "5"}, `invalid tenant ""`},
		{[]string{"set", "acme", "--tokens-per-day", "-5"}, `--tokens-per-day "-5" must be a non-negative integer`},
		{[]string{"set", "acme", "--tokens-per-day=1.5"}, `--tokens-per-day "1.5" must be a non-negative integer`},
		{[]string{"set", "acme", "--tokens-per-day", "lots"}, "must be a non-negative integer"},
		{[]string{"set", "acme", "--tokens-per-day", "99999999999999999999"}, "must be a non-negative integer"},
		{[]string{"set", "acme"}, "give --tokens-per-day N"},
		{[]string{"set", "--tokens-per-day", "5"}, "give one TENANT"},
		{[]string{"set", "acme", "beta", "--tokens-per-day", "5"}, "give one TENANT"},
		{[]string{"set", "acme", "--tokens", "5"}, "flag provided but not defined"},
		{[]string{"delete", "a/b"}, `invalid tenant "a/b"`},
		{[]string{"delete"}, "give one TENANT"},
		{[]string{"list", "acme"}, "tenants list takes no arguments"},
		{[]string{}, "tenants: missing subcommand"},
		{[]string{"frob"}, `unknown subcommand "frob"`},
	} {
		out, errOut, code := tenants(t, getenv, c.args...)
		if code != 2 || !strings.Contains(errOut, c.want) || out != "" {
			t.Errorf("tenants %q: exit %d, stdout %q, stderr %q; want exit 2 and %q", c.args, code, out, errOut, c.want)
		}
		if n := strings.Count(strings.TrimSpace(errOut), "\n"); !strings.Contains(c.want, "flag provided") && n != 0 {
			t.Errorf("tenants %q: want a one-line error, got %q", c.args, errOut)
		}
	}
	if own, err := pgbudget.New(pool).List(context.Background()); err != nil || len(own) != 0 {
		t.Errorf("tenant_budgets after refused commands: %v %v; want nothing written", own, err)
	}
	if _, errOut, code := tenants(t, getenv, "-h"); code != 0 || !strings.Contains(errOut, "set TENANT --tokens-per-day N") {
		t.Errorf("tenants -h: exit %d: %s", code, errOut)
	}
}

func TestTenantsListShowsTodaysUse(t *testing.T) {
	t.Parallel()
	getenv, rdb, prefix, pool := tenantsEnv(t)
	ctx := context.Background()
	if _, errOut, code := tenants(t, getenv, "set", "acme", "--tokens-per-day", "50000"); code != 0 {
		t.Fatalf("set acme: exit %d: %s", code, errOut)
	}

	// A worker's limiter: acme's budget from tenant_budgets, beta's the default.
	lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, TenantTokenBudget: 1000, Budgets: pgbudget.New(pool),
		SyncInterval: 20 * time.Millisecond, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan struct{})
	go func() { defer close(ran); _ = lim.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-ran })
	testenv.WaitFor(t, 5*time.Second, "the limiter reads acme's budget", func() bool { return lim.Budget("acme") == 50000 })

	callDone := func(tenant string, in, out int) {
		t.Helper()
		p, err := lim.Acquire(ctx, limiter.Call{Model: "gpt-4.1-mini", Tenant: tenant, InputTokens: 100, OutputTokens: 200})
		if err != nil {
			t.Fatalf("acquire for %q: %v", tenant, err)
		}
		p.Done(limiter.Result{Sent: true, Usage: &llm.Usage{InputTokens: in, OutputTokens: out}})
	}
	callDone("acme", 120, 30)
	callDone("beta", 200, 100)
	callDone("", 10, 5)
	held, err := lim.Acquire(ctx, limiter.Call{Model: "gpt-4.1-mini", Tenant: "beta", InputTokens: 100, OutputTokens: 200})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Done(limiter.Result{})
	testenv.WaitFor(t, 5*time.Second, "Run writes the cost view", func() bool {
		u, err := lim.Usage(ctx, time.Now())
		return err == nil && len(u) == 3
	})

	listed := listJSON(t, getenv)
	if len(listed) != 3 {
		t.Fatalf("list --json: %+v; want acme, beta and (none)", listed)
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-12 }
	acme := listed["acme"]
	if acme.TokensPerDay != 50000 || acme.Source != "own" || acme.UsedTokens != 150 || acme.ReservedTokens != 0 ||
		acme.RemainingTokens == nil || *acme.RemainingTokens != 49850 || acme.Calls != 1 || acme.InputTokens != 120 ||
		acme.OutputTokens != 30 || !near(acme.CostUSD, (120*1+30*2)/1e6) {
		t.Errorf("acme: %+v", acme)
	}
	beta := listed["beta"]
	if beta.TokensPerDay != 1000 || beta.Source != "default" || beta.UsedTokens != 300 || beta.ReservedTokens != 300 ||
		beta.RemainingTokens == nil || *beta.RemainingTokens != 400 || beta.Calls != 1 || !near(beta.CostUSD, (200*1+100*2)/1e6) {
		t.Errorf("beta: %+v", beta)
	}
	none := listed[limiter.NoTenant]
	if none.TokensPerDay != 0 || none.Source != "none" || none.UsedTokens != 15 || none.RemainingTokens != nil || none.Calls != 1 {
		t.Errorf("the calls of no tenant: %+v", none)
	}
	if f := tableRow(t, getenv, "beta"); strings.Join(f, " ") != "beta 1000 default 300 300 400 1 0.000400" {
		t.Errorf("beta's row: %q", f)
	}
	if f := tableRow(t, getenv, limiter.NoTenant); strings.Join(f, " ") != "(none) - none 15 0 - 1 0.000020" {
		t.Errorf("the row of no tenant: %q", f)
	}

	// Delete: acme has the default again, and what it used today counts against it.
	if _, errOut, code := tenants(t, getenv, "delete", "acme"); code != 0 {
		t.Fatalf("delete acme: exit %d: %s", code, errOut)
	}
	acme = listJSON(t, getenv)["acme"]
	if acme.TokensPerDay != 1000 || acme.Source != "default" || acme.UsedTokens != 150 || acme.RemainingTokens == nil ||
		*acme.RemainingTokens != 850 || !acme.BudgetUpdatedAt.IsZero() {
		t.Errorf("acme after delete: %+v", acme)
	}
	if f := tableRow(t, getenv, "acme"); strings.Join(f, " ") != "acme 1000 default 150 0 850 1 0.000180" {
		t.Errorf("acme's row after delete: %q", f)
	}
}
