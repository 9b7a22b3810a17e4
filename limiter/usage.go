package limiter

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// CostUSD prices a call of model that used in input and out output tokens, in US
// dollars, by the limiter's price table (Config.Prices, then DefaultPrices); a nil
// Limiter prices by DefaultPrices. A BatchModel name is priced at its model's batch
// price. A model without a price costs 0 and ok is false.
func (l *Limiter) CostUSD(model string, in, out int64) (usd float64, ok bool) {
	var p Price
	if l != nil {
		p = l.priceOf(model)
	} else {
		p = (&Limiter{}).priceOf(model) // DefaultPrices
	}
	if p == (Price{}) {
		return 0, false
	}
	return (float64(in)*p.Input + float64(out)*p.Output) / 1e6, true
}

// TenantUsage is what one tenant spent on one UTC day: the cost view (every call its
// processes settled, written by Run each SyncInterval) and, for a tenant with a
// budget, the budget's own counters.
type TenantUsage struct {
	Tenant string `json:"tenant"`
	// Calls, InputTokens and OutputTokens add up the settled calls of the day (a call
	// charged without a breakdown, its answer lost, counts as input).
	Calls        int64 `json:"calls"`
	InputTokens  int64 `json:"input_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	// CostUSD prices them by the limiter's price table.
	CostUSD float64 `json:"cost_usd"`
	// BudgetUsed and BudgetReserved are the day's budget counters: tokens charged, and
	// tokens held by calls in flight. Zero for a tenant without a budget.
	BudgetUsed     int64 `json:"budget_used"`
	BudgetReserved int64 `json:"budget_reserved"`
	// ByModel splits the cost view by model name.
	ByModel map[string]ModelUsage `json:"by_model,omitempty"`
}

// ModelUsage is one tenant's use of one model on a day.
type ModelUsage struct {
	Calls        int64   `json:"calls"`
	InputTokens  int64   `json:"input_tokens"`
	OutputTokens int64   `json:"output_tokens"`
	CostUSD      float64 `json:"cost_usd"`
}

// Usage returns every tenant's use on day (UTC), from the cost view, with the budget
// counters of those tenants and of also (tenants with budgets that may have no calls
// yet), sorted by tenant; the calls of no tenant are under NoTenant. Two round trips. It
// does not include what processes settled in the last SyncInterval and have not
// written yet.
func (l *Limiter) Usage(ctx context.Context, day time.Time, also ...string) ([]TenantUsage, error) {
	raw, err := l.rdb.HGetAll(ctx, l.keys.Usage(day)).Result()
	if err != nil {
		return nil, fmt.Errorf("limiter: read the usage of %s: %w", day.UTC().Format("2006-01-02"), err)
	}
	byTenant := map[string]*TenantUsage{}
	get := func(t string) *TenantUsage {
		u := byTenant[t]
		if u == nil {
			u = &TenantUsage{Tenant: t, ByModel: map[string]ModelUsage{}}
			byTenant[t] = u
		}
		return u
	}
	for f, v := range raw {
		parts := strings.Split(f, "|")
		n, err := strconv.ParseInt(v, 10, 64)
		if len(parts) != 3 || err != nil {
			continue
		}
		u := get(keyUnescaper.Replace(parts[0]))
		model := keyUnescaper.Replace(parts[1])
		mu := u.ByModel[model]
		switch parts[2] {
		case "in":
			mu.InputTokens += n
		case "out":
			mu.OutputTokens += n
		case "calls":
			mu.Calls += n
		}
		u.ByModel[model] = mu
	}
	for _, t := range also {
		get(t)
	}
	pipe := l.rdb.Pipeline()
	cmds := map[string]*redis.SliceCmd{}
	for t := range byTenant {
		cmds[t] = pipe.HMGet(ctx, l.keys.Budget(t, day), "used", "reserved")
	}
	if len(cmds) > 0 {
		if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
			return nil, fmt.Errorf("limiter: read the budgets of %s: %w", day.UTC().Format("2006-01-02"), err)
		}
	}
	out := make([]TenantUsage, 0, len(byTenant))
	for t, u := range byTenant {
		for name, mu := range u.ByModel {
			p := l.priceOf(name)
			mu.CostUSD = (float64(mu.InputTokens)*p.Input + float64(mu.OutputTokens)*p.Output) / 1e6
			u.ByModel[name] = mu
			u.Calls += mu.Calls
			u.InputTokens += mu.InputTokens
			u.OutputTokens += mu.OutputTokens
			u.CostUSD += mu.CostUSD
		}
		if v := cmds[t].Val(); len(v) == 2 {
			u.BudgetUsed, u.BudgetReserved = parseInt(v[0]), parseInt(v[1])
		}
		out = append(out, *u)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Tenant < out[j].Tenant })
	return out, nil
}

// Budget returns tenant's tokens per day as this limiter applies it: its own budget
// (Config.Budgets, as last read) or Config.TenantTokenBudget; 0 is none.
func (l *Limiter) Budget(tenant string) int64 { return l.budgetFor(tenant) }
