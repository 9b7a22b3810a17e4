package limitbench

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"
)

// collectTimeout bounds the reads after a run (counters, metrics, rows), which happen
// even when the run itself timed out.
const collectTimeout = time.Minute

// tenantName returns the name of tenant number i: tenant-a, tenant-b, ...
func tenantName(i int) string { return "tenant-" + string(rune('a'+i%26)) }

// goodput performs goodput run name (RunConfigured, RunOneTenant, RunLearnt or RunOff).
func (b *bench) goodput(ctx context.Context, name string) (*GoodputResult, error) {
	c := b.cfg
	g := &GoodputResult{Name: name, Admission: name != RunOff, Configured: name == RunConfigured || name == RunOneTenant,
		Tenants: c.Tenants, Jobs: int64(c.Jobs), FirstMinute: c.FirstMinute, RPM: c.RPM, TenantLast: map[string]time.Duration{}}
	if name == RunOneTenant {
		g.Tenants = 1
	}
	s, err := b.newStack(ctx, name)
	if err != nil {
		return nil, err
	}
	defer s.close()
	for i, text := range b.texts(c.Jobs, 0) {
		if err := s.enqueue(ctx, jobID(i%g.Tenants, i), tenantName(i%g.Tenants), text); err != nil {
			return nil, err
		}
	}
	b.logf("%s: %d jobs queued (%d tenants, interleaved); starting %d workers (admission on: %v, limits configured: %v)",
		name, c.Jobs, g.Tenants, c.Workers, g.Admission, g.Configured)
	t0, boot, err := s.startWorkers(ctx, s.workerEnv(g.Admission, g.Configured))
	if err != nil {
		return nil, err
	}
	g.Boot = boot
	rctx, cancel := context.WithTimeout(ctx, c.RunTimeout)
	defer cancel()
	if g.Complete, err = s.waitDone(rctx, t0, g.Jobs); err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), collectTimeout)
	defer ccancel()
	g.Usage = s.usage(cctx)
	if g.Metrics, err = s.metrics(cctx); err != nil {
		return nil, err
	}
	// Stopped before the stores are read: what was in flight is finished or handed back,
	// so that fake-llm's successful answers and the summaries can be compared.
	s.stopWorkers()
	g.DuplicateRuns = s.duplicateRuns()
	if err := b.collectGoodput(cctx, s, t0, g); err != nil {
		return nil, err
	}
	n, w := g.SteadyCalls()
	b.logf("%s: done in %.1fs (complete %v): %d summarised, %d dead letters; steady %d calls in %.1fs = %.1f/min, goodput %.3f; requests %d, 429s %d (%.2f%%)",
		name, g.Wall.Seconds(), g.Complete, g.Summarised, g.DeadLetters, n, w.Seconds(), g.SteadyRPM(), g.Goodput(),
		g.Model.Requests, g.Model.Limited, 100*g.Model.LimitedShare())
	return g, nil
}

// collectGoodput reads what a goodput run did from its stores and fake-llm, once its
// workers stopped.
func (b *bench) collectGoodput(ctx context.Context, s *stack, t0 time.Time, g *GoodputResult) error {
	var err error
	if g.Model, err = s.model(ctx); err != nil {
		return err
	}
	if g.DeadLetters, err = s.deadLetters(ctx); err != nil {
		return err
	}
	if g.DeadReasons, err = s.deadReasons(ctx, 5); err != nil {
		return err
	}
	if g.Outbox, err = s.count(ctx, `SELECT count(*) FROM outbox`); err != nil {
		return err
	}
	rows, err := s.pool.Query(ctx, `SELECT tenant, created_at FROM summaries`)
	if err != nil {
		return fmt.Errorf("read summaries: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var tenant string
		var at time.Time
		if err := rows.Scan(&tenant, &at); err != nil {
			return fmt.Errorf("read summaries: %w", err)
		}
		d := at.Sub(t0)
		g.Done = append(g.Done, d)
		g.TenantLast[tenant] = max(g.TenantLast[tenant], d)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read summaries: %w", err)
	}
	slices.Sort(g.Done)
	g.Summarised = int64(len(g.Done))
	if len(g.Done) > 0 {
		g.Wall = g.Done[len(g.Done)-1]
	}
	return nil
}

// fairness performs the fairness run: tenant-a's backlog, then tenant-b's few jobs.
func (b *bench) fairness(ctx context.Context) (*FairnessResult, error) {
	c := b.cfg
	f := &FairnessResult{Backlog: c.Jobs, Late: c.FairnessJobs, Warmup: c.FairnessWarmup, RPM: c.RPM, ProviderLeft: -1,
		FairShare: time.Duration(float64(c.FairnessJobs) / (float64(c.RPM) / 2) * float64(time.Minute))}
	s, err := b.newStack(ctx, RunFairness)
	if err != nil {
		return nil, err
	}
	defer s.close()
	for i, text := range b.texts(c.Jobs, 1) {
		if err := s.enqueue(ctx, jobID(0, i), tenantName(0), text); err != nil {
			return nil, err
		}
	}
	b.logf("fairness: %d jobs of %s queued; starting %d workers (admission on, limits configured)", c.Jobs, tenantName(0), c.Workers)
	t0, _, err := s.startWorkers(ctx, s.workerEnv(true, true))
	if err != nil {
		return nil, err
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(time.Until(t0.Add(c.FairnessWarmup))):
	}
	late := b.texts(c.FairnessJobs, 2)
	left, probeStatus, err := s.probe(ctx)
	if err != nil {
		return nil, err
	}
	if left >= 0 && probeStatus == http.StatusOK {
		left++ // what the bucket held before the probe took one
	}
	f.ProviderLeft = left
	tB := time.Now()
	for i, text := range late {
		if err := s.enqueue(ctx, jobID(1, i), tenantName(1), text); err != nil {
			return nil, err
		}
	}
	b.logf("fairness: %d jobs of %s queued at +%.1fs; fake-llm's requests bucket held %d (probe: HTTP %d)",
		c.FairnessJobs, tenantName(1), tB.Sub(t0).Seconds(), left, probeStatus)
	deadline := time.Now().Add(max(2*time.Minute, 30*f.FairShare))
	for {
		n, err := s.count(ctx, `SELECT count(*) FROM summaries WHERE tenant = $1`, tenantName(1))
		if err != nil {
			return nil, err
		}
		f.LateDone = int(n)
		if f.LateDone >= f.Late {
			f.Complete = true
			break
		}
		if time.Now().After(deadline) {
			b.logf("fairness: only %d of %d late jobs done after %v", f.LateDone, f.Late, time.Since(tB).Round(time.Second))
			break
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), collectTimeout)
	defer cancel()
	f.Usage = s.usage(cctx)
	if f.Metrics, err = s.metrics(cctx); err != nil {
		return nil, err
	}
	s.stopWorkers() // what was in flight is finished or handed back: the counts below agree
	if f.Model, err = s.model(cctx); err != nil {
		return nil, err
	}
	f.Model.Requests-- // the probe's
	switch probeStatus {
	case http.StatusOK:
		f.Model.OK--
	case http.StatusTooManyRequests:
		f.Model.Limited--
	default:
		f.Model.Other--
	}
	if f.DeadLetters, err = s.deadLetters(cctx); err != nil {
		return nil, err
	}
	if f.DeadReasons, err = s.deadReasons(cctx, 5); err != nil {
		return nil, err
	}
	if f.LateDone > 0 {
		var first, last time.Time
		if err := s.pool.QueryRow(cctx, `SELECT min(created_at), max(created_at) FROM summaries WHERE tenant = $1`, tenantName(1)).
			Scan(&first, &last); err != nil {
			return nil, fmt.Errorf("read the late summaries: %w", err)
		}
		f.First, f.Last = first.Sub(tB), last.Sub(tB)
		if f.BacklogDuring, err = s.count(cctx, `SELECT count(*) FROM summaries WHERE tenant = $1 AND created_at >= $2 AND created_at <= $3`,
			tenantName(0), tB, last); err != nil {
			return nil, err
		}
	}
	if f.Summarised, err = s.count(cctx, `SELECT count(*) FROM summaries`); err != nil {
		return nil, err
	}
	b.logf("fairness: late jobs first done +%.2fs, last +%.2fs (fair share %.1fs, ratio %.2f); %s jobs done meanwhile: %d",
		f.First.Seconds(), f.Last.Seconds(), f.FairShare.Seconds(), f.Ratio(), tenantName(0), f.BacklogDuring)
	return f, nil
}
