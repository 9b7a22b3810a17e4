package adminui

import (
	"context"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/onceflow/onceflow"
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
	// Waiting is what waits for an operator: nil without PostgreSQL.
	Waiting *waitingView
}

// waitingView is the overview's count of the tool calls waiting for approval and its
// list of the jobs in doubt, each bounded by overviewWaiting.
type waitingView struct {
	Approvals     int
	ApprovalsMore bool
	InDoubt       []inDoubtJob
	InDoubtMore   bool
	Err           string
}

// inDoubtJob is a job in doubt on the overview, linked to its page.
type inDoubtJob struct {
	onceflow.InDoubtJob
	Path string
}

// overviewWaiting bounds the approvals the overview counts and the jobs in doubt it
// lists (it is rendered every 5 seconds while open).
const overviewWaiting = 20

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
	if u.db != nil {
		d.Waiting = u.waiting(ctx)
	}
	u.render(w, r, http.StatusOK, "overview", page{Title: "Overview", Nav: "overview", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}

// waiting reads what waits for an operator: the tool calls waiting for approval
// (counted up to overviewWaiting) and the jobs in doubt (the oldest overviewWaiting).
func (u *UI) waiting(ctx context.Context) *waitingView {
	v := &waitingView{}
	in := u.client.Inspector()
	approvals, err := in.Approvals(ctx, "", true, overviewWaiting+1)
	if err == nil {
		var jobs []onceflow.InDoubtJob
		if jobs, err = in.InDoubt(ctx, overviewWaiting+1); err == nil {
			v.Approvals, v.ApprovalsMore = min(len(approvals), overviewWaiting), len(approvals) > overviewWaiting
			v.InDoubtMore = len(jobs) > overviewWaiting
			for _, j := range jobs[:min(len(jobs), overviewWaiting)] {
				v.InDoubt = append(v.InDoubt, inDoubtJob{InDoubtJob: j, Path: u.base + "jobs/" + url.PathEscape(j.JobID)})
			}
		}
	}
	if err != nil {
		v.Err = "unavailable"
		u.log.WarnContext(ctx, "adminui: read the approvals and the jobs in doubt", "err", err)
	}
	return v
}
