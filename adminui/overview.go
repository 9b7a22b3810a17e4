package adminui

import (
	"net/http"
	"slices"
	"time"

	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/queue"
)

// queueRow is one queue on the overview.
type queueRow struct {
	Name string
	queue.Stats
	Err   string
	Chart chart
}

// dependency is one circuit breaker on the overview.
type dependency struct {
	Name  string
	Open  bool
	Cause string
}

// overviewData is the overview page's.
type overviewData struct {
	Queues       []queueRow
	Dependencies []dependency
	Usage        []limiter.TenantUsage
	UsageErr     string
	HasLimiter   bool
	Models       []limiter.ModelState
}

// overview serves GET /ui/: every queue's numbers, the dependencies' breakers and the
// limiter's use today.
func (u *UI) overview(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	ctx := r.Context()
	var d overviewData
	for _, keys := range u.partitions(ctx) {
		name := keys.Name()
		row := queueRow{Name: name}
		st, err := queue.ReadStats(ctx, u.rdb, keys, queue.DefaultGroup)
		if err != nil {
			row.Err = "unavailable"
			u.log.WarnContext(ctx, "adminui: read queue stats", "queue", name, "err", err)
		}
		row.Stats = st
		if row.Chart, err = u.readChart(ctx, name); err != nil {
			u.log.WarnContext(ctx, "adminui: read the queue's samples", "queue", name, "err", err)
		}
		d.Queues = append(d.Queues, row)
	}
	for _, b := range u.client.Inspector().Breakers() {
		dep := dependency{Name: b.Name()}
		if err := b.Err(); err != nil {
			dep.Open, dep.Cause = true, err.Error()
		}
		d.Dependencies = append(d.Dependencies, dep)
	}
	if l := u.client.Inspector().Limiter(); l != nil {
		d.HasLimiter = true
		usage, err := l.Usage(ctx, u.now())
		if err != nil {
			d.UsageErr = "unavailable"
			u.log.WarnContext(ctx, "adminui: read limiter usage", "err", err)
		}
		d.Usage = usage
		models := l.Models()
		for _, tu := range usage {
			for m := range tu.ByModel {
				if !slices.Contains(models, m) {
					models = append(models, m)
				}
			}
		}
		slices.Sort(models)
		if d.Models, err = l.State(ctx, models...); err != nil {
			d.UsageErr = "unavailable"
			u.log.WarnContext(ctx, "adminui: read limiter state", "err", err)
		}
	}
	u.render(w, r, http.StatusOK, "overview", page{Title: "Overview", Nav: "overview", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}
