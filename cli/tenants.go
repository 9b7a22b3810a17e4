package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/limiter/pgbudget"
	"github.com/onceflow/onceflow/queue"
)

// tenantsUsage is the help of `tenants`.
var tenantsUsage = "set TENANT --tokens-per-day N | delete TENANT | list [--json]\n\n" +
	"set gives TENANT its own budget of N model tokens (prompt and output) per UTC day; 0 is no\n" +
	"budget for this tenant. delete takes it away: the tenant has ONCEFLOW_TENANT_TOKEN_BUDGET\n" +
	"again. Workers apply either within " + limiter.DefaultBudgetRefresh.String() + ". list shows, for every tenant with its own budget or\n" +
	"with model calls today (UTC), the budget in force, tokens used and reserved, what remains,\n" +
	"calls and their cost in US dollars (ONCEFLOW_LLM_PRICES over the built-in prices)."

// runTenants manages the tenants' own daily token budgets (tenant_budgets, package
// pgbudget) and shows their use today (the limiter's counters in Redis).
func runTenants(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "tenants", tenantsUsage, args); err != nil {
		return err
	}
	switch args[0] {
	case "set":
		return tenantsSet(ctx, e, args[1:])
	case "delete":
		return tenantsDelete(ctx, e, args[1:])
	case "list":
		return tenantsList(ctx, e, args[1:])
	default:
		return usageErrorf("tenants: unknown subcommand %q; want set, delete or list", args[0])
	}
}

// tenantArg checks the one positional argument of set and delete: a tenant name.
func tenantArg(sub string, pos []string) (string, error) {
	if len(pos) != 1 {
		return "", usageErrorf("tenants %s: give one TENANT, got %d arguments", sub, len(pos))
	}
	if t := pos[0]; t == "" || !queue.ValidTenant(t) {
		// pgbudget.ErrInvalidTenant's rule, without its package prefix.
		rule := strings.TrimPrefix(pgbudget.ErrInvalidTenant.Error(), "pgbudget: ")
		return "", usageErrorf("tenants %s: invalid tenant %q (%s)", sub, t, rule)
	}
	return pos[0], nil
}

func tenantsSet(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "tenants set", "TENANT --tokens-per-day N", config.GroupPostgres)
	loader := config.Register(fs)
	perDay := fs.String("tokens-per-day", "", "the tenant's model tokens per UTC day, prompt and output (0: no budget for this tenant)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	tenant, err := tenantArg("set", pos)
	if err != nil {
		return err
	}
	if *perDay == "" {
		return usageErrorf("tenants set: give --tokens-per-day N (0: no budget for this tenant)")
	}
	n, err := strconv.ParseInt(*perDay, 10, 64)
	if err != nil || n < 0 {
		return usageErrorf("tenants set: --tokens-per-day %q must be a non-negative integer (0: no budget for this tenant)", *perDay)
	}
	cfg, err := settings(e, loader)
	if err != nil {
		return err
	}
	pool, err := tenantsPostgres(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgbudget.New(pool).Set(ctx, tenant, n); err != nil {
		if errors.Is(err, pgbudget.ErrInvalidTenant) {
			return &usageError{err}
		}
		return budgetTableHint(e, err)
	}
	what := strconv.FormatInt(n, 10) + " tokens per day (its own budget)"
	if n == 0 {
		what = "unlimited (its own setting: no token budget)"
	}
	fmt.Fprintf(e.stdout, "tenant %s: %s; workers apply it within %s\n", tenant, what, limiter.DefaultBudgetRefresh)
	return nil
}

func tenantsDelete(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "tenants delete", "TENANT", config.GroupPostgres, config.GroupLimits)
	loader := config.Register(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	tenant, err := tenantArg("delete", pos)
	if err != nil {
		return err
	}
	cfg, err := settings(e, loader)
	if err != nil {
		return err
	}
	pool, err := tenantsPostgres(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgbudget.New(pool).Delete(ctx, tenant); err != nil {
		return budgetTableHint(e, err)
	}
	fmt.Fprintf(e.stdout, "tenant %s: the default budget, %s (ONCEFLOW_TENANT_TOKEN_BUDGET); workers apply it within %s\n",
		tenant, perDayText(cfg.TenantTokenBudget), limiter.DefaultBudgetRefresh)
	return nil
}

// Budget sources of a tenantRow.
const (
	budgetOwn     = "own"     // the tenant's row in tenant_budgets
	budgetDefault = "default" // ONCEFLOW_TENANT_TOKEN_BUDGET
	budgetNone    = "none"    // the calls of no tenant (limiter.NoTenant): never budgeted
)

// tenantsListing is `tenants list --json`: one object.
type tenantsListing struct {
	// Day is the UTC day the counters are of (YYYY-MM-DD).
	Day string `json:"day"`
	// DefaultTokensPerDay is ONCEFLOW_TENANT_TOKEN_BUDGET (0: unlimited).
	DefaultTokensPerDay int64       `json:"default_tokens_per_day"`
	Tenants             []tenantRow `json:"tenants"`
}

// tenantRow is one tenant of `tenants list`.
type tenantRow struct {
	// Tenant is the tenant's name; "(none)" (limiter.NoTenant) for calls of no tenant.
	Tenant string `json:"tenant"`
	// TokensPerDay is the budget in force (0: unlimited), from Source: "own" (tenants
	// set), "default" (ONCEFLOW_TENANT_TOKEN_BUDGET) or "none" (no tenant).
	TokensPerDay int64  `json:"tokens_per_day"`
	Source       string `json:"source"`
	// UsedTokens are the tokens charged today: the budget's counter when the tenant has
	// one, else the tokens of its settled calls. ReservedTokens are held by calls in
	// flight (budgeted tenants only). RemainingTokens is what the budget still admits;
	// null when unlimited.
	UsedTokens      int64  `json:"used_tokens"`
	ReservedTokens  int64  `json:"reserved_tokens"`
	RemainingTokens *int64 `json:"remaining_tokens"`
	// Calls, InputTokens, OutputTokens and CostUSD are the day's settled calls (the
	// limiter's cost view, up to a second behind), priced by ONCEFLOW_LLM_PRICES over
	// the built-in prices; ByModel splits them.
	Calls        int64                         `json:"calls"`
	InputTokens  int64                         `json:"input_tokens"`
	OutputTokens int64                         `json:"output_tokens"`
	CostUSD      float64                       `json:"cost_usd"`
	ByModel      map[string]limiter.ModelUsage `json:"by_model,omitempty"`
	// BudgetUpdatedAt is when the tenant's own budget was last set; absent for others.
	BudgetUpdatedAt *time.Time `json:"budget_updated_at,omitempty"`
}

func tenantsList(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "tenants list", "[--json]", config.GroupRedis, config.GroupPostgres, config.GroupLimits, config.GroupLogs)
	asJSON := fs.Bool("json", false, `print one JSON object on stdout: {"day", "default_tokens_per_day", "tenants": [...]}`)
	cfg, log, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErrorf("tenants list takes no arguments, got %q", fs.Args())
	}
	pool, err := tenantsPostgres(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb, err := newRedis(cfg)
	if err != nil {
		return err
	}
	defer rdb.Close()

	own, err := pgbudget.New(pool).List(ctx)
	if err != nil {
		return budgetTableHint(e, err)
	}
	listing, err := tenantsListingOf(ctx, rdb, cfg, log, own, time.Now())
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(listing)
	}
	if len(listing.Tenants) == 0 {
		fmt.Fprintf(e.stdout, "no tenant has its own budget or called the model on %s (UTC); the default budget is %s\n",
			listing.Day, perDayText(listing.DefaultTokensPerDay))
		return nil
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "TENANT\tTOKENS/DAY\tBUDGET\tUSED\tRESERVED\tREMAINING\tCALLS\tCOST_USD")
	for _, r := range listing.Tenants {
		perDay, remaining := "unlimited", "-"
		if r.Source == budgetNone {
			perDay = "-"
		}
		if r.RemainingTokens != nil {
			perDay, remaining = strconv.FormatInt(r.TokensPerDay, 10), strconv.FormatInt(*r.RemainingTokens, 10)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%d\t%s\t%d\t%.6f\n", r.Tenant, perDay, r.Source, r.UsedTokens, r.ReservedTokens,
			remaining, r.Calls, r.CostUSD)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\n%s (UTC); the default budget is %s (ONCEFLOW_TENANT_TOKEN_BUDGET)\n",
		listing.Day, perDayText(listing.DefaultTokensPerDay))
	return nil
}

// tenantsListingOf reads the use on now's UTC day of the tenants with a model call that
// day or a budget of their own (own), through a limiter with the deployment's prefix,
// prices and default budget.
func tenantsListingOf(ctx context.Context, rdb redis.UniversalClient, cfg *config.Config, log *slog.Logger, own []pgbudget.Budget, now time.Time) (*tenantsListing, error) {
	lim, err := limiter.New(rdb, limiter.Config{Prefix: cfg.Prefix, Prices: cfg.LLMPrices, TenantTokenBudget: cfg.TenantTokenBudget, Logger: log})
	if err != nil {
		return nil, err
	}
	budgets := make(map[string]int64, len(own))
	updated := make(map[string]time.Time, len(own))
	names := make([]string, 0, len(own))
	for _, b := range own {
		budgets[b.Tenant], updated[b.Tenant] = b.TokensPerDay, b.UpdatedAt
		names = append(names, b.Tenant)
	}
	lim.SetBudgets(budgets)
	usage, err := lim.Usage(ctx, now, names...)
	if err != nil {
		return nil, err
	}
	out := &tenantsListing{Day: now.UTC().Format(time.DateOnly), DefaultTokensPerDay: cfg.TenantTokenBudget, Tenants: make([]tenantRow, 0, len(usage))}
	for _, u := range usage {
		r := tenantRow{Tenant: u.Tenant, Source: budgetDefault, ReservedTokens: u.BudgetReserved, Calls: u.Calls,
			InputTokens: u.InputTokens, OutputTokens: u.OutputTokens, CostUSD: u.CostUSD, UsedTokens: u.InputTokens + u.OutputTokens}
		if len(u.ByModel) > 0 {
			r.ByModel = u.ByModel
		}
		switch at, ok := updated[u.Tenant]; {
		case u.Tenant == limiter.NoTenant:
			r.Source = budgetNone
		case ok:
			r.Source, r.BudgetUpdatedAt = budgetOwn, &at
			r.TokensPerDay = lim.Budget(u.Tenant)
		default:
			r.TokensPerDay = lim.Budget(u.Tenant)
		}
		if r.TokensPerDay > 0 {
			// The budget's own counters: what the limiter admits against, up to date.
			r.UsedTokens = u.BudgetUsed
			left := max(r.TokensPerDay-u.BudgetUsed-u.BudgetReserved, 0)
			r.RemainingTokens = &left
		}
		out.Tenants = append(out.Tenants, r)
	}
	return out, nil
}

// tenantsPostgres opens the pool of ONCEFLOW_DATABASE_URL (lazily: a bad URL is a
// configuration error, an unreachable server fails the first query).
func tenantsPostgres(ctx context.Context, cfg *config.Config) (*pgxpool.Pool, error) {
	pool, err := onceflow.NewPostgres(ctx, cfg.DatabaseURL)
	if err != nil {
		return nil, &config.Error{Name: "ONCEFLOW_DATABASE_URL", Value: config.RedactURL(cfg.DatabaseURL), Err: err}
	}
	return pool, nil
}

// budgetTableHint adds what to do when tenant_budgets does not exist yet.
func budgetTableHint(e *env, err error) error {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == "42P01" { // undefined_table
		return fmt.Errorf("%w (run `%s migrate` first)", err, e.app.Name)
	}
	return err
}

// perDayText says a budget of n tokens per day in words.
func perDayText(n int64) string {
	if n == 0 {
		return "no token budget (unlimited)"
	}
	return strconv.FormatInt(n, 10) + " tokens per day"
}
