package adminui

import (
	"github.com/onceflow/onceflow/limiter"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/onceflow/onceflow/ledger"
)

// callsPageSize is the rows the model-calls page lists.
const callsPageSize = 100

// callsData is the model-calls page's.
type callsData struct {
	States                    []string
	State, Model, Job, Tenant string
	Rows                      []callRow
	// CostUSD adds up the listed rows' cost; Unpriced counts those of a model without a
	// price.
	CostUSD          float64
	Unpriced         int
	HasLimiter       bool   // prices from its table (ONCEFLOW_LLM_PRICES), else the defaults
	Next             string // the Before of the next page (RFC 3339), "" for none
	Hours            []ledger.HourStats
	Calls, Ambiguous int64
	AmbiguousPercent float64
	NoDB             bool
}

// callRow is a ledger row with what its answer's tokens cost.
type callRow struct {
	ledger.Summary
	CostUSD float64
	Priced  bool
	Batch   bool // answered through the provider's batch API, priced at its batch price
}

// calls serves GET /ui/calls: the model-call ledger (llm_calls), newest first, by
// state (in flight, succeeded, failed, ambiguous), model and job, with the tokens of
// each answer, and the share of calls with an ambiguous attempt per hour over the last
// day: what seed 001 asks users to measure before they change providers.
func (u *UI) calls(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	ctx := r.Context()
	d := callsData{States: []string{"", ledger.StateInFlight, ledger.StateSucceeded, ledger.StateFailed, ledger.StateAmbiguous},
		State: r.FormValue("state"), Model: strings.TrimSpace(r.FormValue("model")), Job: strings.TrimSpace(r.FormValue("job")),
		Tenant: strings.TrimSpace(r.FormValue("tenant"))}
	if !slices.Contains(d.States, d.State) {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Unknown state", CSRF: s.csrf, Error: "The state must be in_flight, succeeded, failed or ambiguous."})
		return
	}
	if len(d.Model) > 200 || len(d.Job) > 255 || len(d.Tenant) > 255 {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Too long", CSRF: s.csrf, Error: "The model, job or tenant is too long."})
		return
	}
	l := u.ledger
	if l == nil {
		d.NoDB = true
		u.render(w, r, http.StatusOK, "calls", page{Title: "Model calls", Nav: "calls", CSRF: s.csrf, Data: d})
		return
	}
	opts := ledger.ListOptions{State: d.State, Model: d.Model, Job: d.Job, Tenant: d.Tenant, Limit: callsPageSize}
	if b, err := time.Parse(time.RFC3339Nano, r.FormValue("before")); err == nil {
		opts.Before = b
	}
	rows, err := l.List(ctx, opts)
	if err != nil {
		u.unavailable(w, r, err)
		return
	}
	lim := u.client.Inspector().Limiter() // its price table; without one, limiter.DefaultPrices
	d.HasLimiter = lim != nil
	for _, row := range rows {
		cr := callRow{Summary: row, Batch: strings.HasSuffix(row.Provider, ledger.BatchSuffix)}
		if row.InputTokens+row.OutputTokens > 0 {
			model := row.Model
			if cr.Batch {
				model = limiter.BatchModel(model) // at the batch price
			}
			cr.CostUSD, cr.Priced = lim.CostUSD(model, row.InputTokens, row.OutputTokens)
			if !cr.Priced {
				d.Unpriced++
			}
		}
		d.CostUSD += cr.CostUSD
		d.Rows = append(d.Rows, cr)
	}
	if len(rows) == callsPageSize {
		d.Next = rows[len(rows)-1].CreatedAt.UTC().Format(time.RFC3339Nano)
	}
	if d.Hours, err = l.Hourly(ctx, u.now().Add(-24*time.Hour)); err != nil {
		u.unavailable(w, r, err)
		return
	}
	for _, h := range d.Hours {
		d.Calls += h.Calls
		d.Ambiguous += h.Ambiguous
	}
	if d.Calls > 0 {
		d.AmbiguousPercent = 100 * float64(d.Ambiguous) / float64(d.Calls)
	}
	u.render(w, r, http.StatusOK, "calls", page{Title: "Model calls", Nav: "calls", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}
