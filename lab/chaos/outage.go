package chaos

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// OutageConfig sets up an outage run (RunOutage): the claim that outages never
// dead-letter work. With load running throughout and the workers restarted one at a
// time with SIGTERM every RestartEvery, it stops PostgreSQL cleanly for Postgres, makes
// the model answer 503 to everything for Model, and stops Redis cleanly for Redis, one
// after the other with Gap of plain load before, between and after them; an outage
// begins only once the backlog of the one before it is done, so that each outage's
// drain time is its own.
type OutageConfig struct {
	// Bin is the onceflow binary. Required.
	Bin string
	// Dir holds the run's data and logs (as Config.Dir). Required.
	Dir string
	// Seed drives the jobs. Default: the current time.
	Seed uint64
	// Postgres, Model and Redis are the lengths of the three outages. Default: 2m,
	// 2m, 1m (the long profile).
	Postgres, Model, Redis time.Duration
	// Gap is the load without an outage before the first outage, between two and after
	// the last: at least Gap, and after an outage until its backlog is done (at most
	// DrainTimeout after its end). Default: 20s.
	Gap time.Duration
	// RestartEvery is the pause between two rolling SIGTERM restarts of the workers
	// (one at a time, restarted once it exited), for the whole load phase. Default: 10s.
	RestartEvery time.Duration
	// Workers is the number of `onceflow work` processes. Default: 3.
	Workers int
	// ModelLatency is the time the model takes to answer. Default: 5s.
	ModelLatency time.Duration
	// ShutdownTimeout is the workers' ONCEFLOW_SHUTDOWN_TIMEOUT, shorter than
	// ModelLatency so that a SIGTERM finds jobs that cannot finish. Default: 2s.
	ShutdownTimeout time.Duration
	// ClaimIdle and MaxDeliveries are ONCEFLOW_CLAIM_IDLE and ONCEFLOW_MAX_DELIVERIES.
	// Default: 2s and 3.
	ClaimIdle     time.Duration
	MaxDeliveries int
	// Clients and Think are the load (as in Config). Default: 6 clients, 1s (about 6
	// jobs/s, a third of what three workers at 64 jobs of 5 s each can run, so that
	// the backlog of an outage drains in about half the outage's length).
	Clients int
	Think   time.Duration
	// PoisonRate is the share of jobs with a text the model refuses. Default: 0.02.
	PoisonRate float64
	// PollEvery is the pause between two readings of the workers' /readyz and /metrics
	// while an outage lasts. Default: 1s.
	PollEvery time.Duration
	// DrainTimeout bounds the wait for the backlog after the load stops, and the wait of
	// each outage's backlog after the outage. Default: 3m.
	DrainTimeout time.Duration
	// Log receives progress and the event log. Default: io.Discard.
	Log io.Writer
}

func (c *OutageConfig) withDefaults() {
	c.Seed = cmp.Or(c.Seed, uint64(time.Now().UnixNano()%1e9))
	c.Postgres = cmp.Or(c.Postgres, 2*time.Minute)
	c.Model = cmp.Or(c.Model, 2*time.Minute)
	c.Redis = cmp.Or(c.Redis, time.Minute)
	c.Gap = cmp.Or(c.Gap, 20*time.Second)
	c.RestartEvery = cmp.Or(c.RestartEvery, 10*time.Second)
	c.Workers = cmp.Or(c.Workers, 3)
	c.ModelLatency = cmp.Or(c.ModelLatency, 5*time.Second)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, 2*time.Second)
	c.ClaimIdle = cmp.Or(c.ClaimIdle, 2*time.Second)
	c.MaxDeliveries = cmp.Or(c.MaxDeliveries, 3)
	c.Clients = cmp.Or(c.Clients, 6)
	c.Think = cmp.Or(c.Think, time.Second)
	c.PoisonRate = cmp.Or(c.PoisonRate, 0.02)
	c.PollEvery = cmp.Or(c.PollEvery, time.Second)
	c.DrainTimeout = cmp.Or(c.DrainTimeout, 3*time.Minute)
	if c.Log == nil {
		c.Log = io.Discard
	}
}

// loadDuration is the shortest length of the load phase: the outages and the gaps
// around them.
func (c *OutageConfig) loadDuration() time.Duration {
	return 4*c.Gap + c.Postgres + c.Model + c.Redis
}

// OutageReport is the outcome of an outage run.
type OutageReport struct {
	Seed     uint64
	Duration time.Duration
	// Settings names the run's settings, for the report's heading.
	Settings string
	// Phases are the baseline (load and restarts only) and the three outages, each
	// with what happened from its start to the next one's.
	Phases []PhaseReport
	// Accepted, Poison, Summaries and DeadLettered are totals (as in Report).
	Accepted, Poison    int
	Summaries           int64
	DeadLettered        int
	DeadByReason        map[string]int
	Deliveries          int
	DuplicateSummaries  int
	DuplicateDeliveries int
	ModelRequests       int64
	// Restarts counts the rolling SIGTERM restarts; BadExits those that did not exit 0
	// within the shutdown timeout (plus a margin).
	Restarts, BadExits int
	// HandedBack counts the workers' "handed back without spending a delivery" log lines.
	HandedBack int
	// Drained is the time from the end of the load to the backlog drained (-1: not
	// within DrainTimeout).
	Drained    time.Duration
	Events     []string
	Violations []string
}

// PhaseReport is one phase of an outage run. Jobs count in the phase in which they
// were accepted; dead letters in the phase in which they were dead-lettered.
type PhaseReport struct {
	// Name is "baseline", or the dependency of the outage: "postgres", "llm", "redis".
	Name string
	// What says what the phase does.
	What string
	// Start is the phase's start since the run's; Outage is the outage's length (0
	// for the baseline).
	Start, Outage time.Duration
	// Accepted counts the jobs first acknowledged during the phase; Poison those among
	// them that are poison.
	Accepted, Poison int
	// DeadByReason counts the dead letters written during the phase by reason
	// ("permanent", "exceeded 3 deliveries", ...).
	DeadByReason map[string]int
	// DuplicateSummaries and DuplicateDeliveries count summaries and sink deliveries
	// beyond the first of the phase's jobs.
	DuplicateSummaries, DuplicateDeliveries int
	// Drained is the time from the outage's end until every job accepted before it had
	// its summary (or was dead-lettered); -1 when that did not happen within
	// DrainTimeout.
	Drained time.Duration
	// Seen is what the workers' /readyz and /metrics said while the outage lasted.
	Seen Observation
}

// Observation is what the polls of the workers' /readyz and /metrics saw of one
// dependency during an outage.
type Observation struct {
	// Polls counts the answered /readyz requests; Named those whose body named the
	// dependency as not "ok" (unavailable or degraded). FirstNamed is the time from
	// the outage's start to the first such answer (-1: none); Sample is the first
	// such check text.
	Polls, Named int
	FirstNamed   time.Duration
	Sample       string
	// MetricPolls counts the answered /metrics requests; MetricOpen those with
	// onceflow_breaker_open{dependency="..."} 1; FirstOpen as FirstNamed.
	MetricPolls, MetricOpen int
	FirstOpen               time.Duration
}

// Failed reports whether an invariant was violated.
func (r *OutageReport) Failed() bool { return len(r.Violations) > 0 }

// String renders the report as Markdown that can be pasted into docs/RELIABILITY.md:
// the settings, a table of the phases, the totals, then violations and, on failure,
// the event log.
func (r *OutageReport) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "outage run seed=%d duration=%s: %s\n\n", r.Seed, r.Duration, r.Settings)
	b.WriteString("| phase | outage | jobs accepted (poison) | dead letters by reason | duplicate summaries / deliveries | backlog done after the outage (summary or dead letter) | /readyz named it | breaker metric open |\n")
	b.WriteString("| --- | ---: | ---: | --- | ---: | ---: | --- | --- |\n")
	for _, p := range r.Phases {
		outage, drained, readyz, metric := "-", "-", "-", "-"
		if p.Outage > 0 {
			outage = p.Outage.String()
			drained = fmtDrained(p.Drained)
			readyz = fmt.Sprintf("%d of %d polls%s", p.Seen.Named, p.Seen.Polls, fmtFirst(p.Seen.FirstNamed))
			if p.Seen.Sample != "" {
				readyz += fmt.Sprintf(" (`%s`)", clipText(p.Seen.Sample, 60))
			}
			metric = fmt.Sprintf("%d of %d polls%s", p.Seen.MetricOpen, p.Seen.MetricPolls, fmtFirst(p.Seen.FirstOpen))
		}
		fmt.Fprintf(&b, "| %s | %s | %d (%d) | %s | %d / %d | %s | %s | %s |\n", p.What, outage, p.Accepted, p.Poison,
			fmtReasons(p.DeadByReason), p.DuplicateSummaries, p.DuplicateDeliveries, drained, readyz, metric)
	}
	perJob := 0.0
	if r.Accepted > 0 {
		perJob = float64(r.ModelRequests) / float64(r.Accepted)
	}
	fmt.Fprintf(&b, "\nTotals: %d jobs accepted (%d poison), %d summaries, %d dead letters (%s), %d deliveries, "+
		"%d duplicate summaries, %d duplicate deliveries, %d model requests (%.2f per job), %d SIGTERM restarts (%d not exiting 0 in time), "+
		"%d deliveries handed back, backlog drained %s after the load stopped.\n",
		r.Accepted, r.Poison, r.Summaries, r.DeadLettered, fmtReasons(r.DeadByReason), r.Deliveries,
		r.DuplicateSummaries, r.DuplicateDeliveries, r.ModelRequests, perJob, r.Restarts, r.BadExits,
		r.HandedBack, fmtDrained(r.Drained))
	if len(r.Violations) == 0 {
		b.WriteString("\nInvariants: all hold.\n")
	} else {
		b.WriteString("\n")
	}
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "- VIOLATION: %s\n", v)
	}
	if r.Failed() {
		b.WriteString("\nevent log:\n")
		for _, e := range r.Events {
			fmt.Fprintf(&b, "  %s\n", e)
		}
	}
	return b.String()
}

func fmtDrained(d time.Duration) string {
	if d < 0 {
		return "not drained"
	}
	return d.Round(100 * time.Millisecond).String()
}

func fmtFirst(d time.Duration) string {
	if d < 0 {
		return ""
	}
	return fmt.Sprintf(", first after %s", d.Round(100*time.Millisecond))
}

func fmtReasons(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s: %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func clipText(s string, n int) string {
	s = strings.ReplaceAll(s, "`", "'")
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// deadReason is a dead letter's reason without its detail: "permanent", "malformed"
// or "exceeded N deliveries".
func deadReason(reason string) string {
	reason, _, _ = strings.Cut(reason, ";")
	if kind, _, ok := strings.Cut(reason, ":"); ok {
		return kind
	}
	return reason
}

// outage is one of the three outages: how to start and end it.
type outage struct {
	dep, what string
	length    time.Duration
	begin     func(ctx context.Context) error
	end       func(ctx context.Context) error
}

// outageRun is an outage run's state beside the shared run.
type outageRun struct {
	*run
	ocfg OutageConfig

	mu       sync.Mutex
	restarts int
	badExits []string
	phases   []PhaseReport
	starts   []time.Time // of each phase
}

// RunOutage performs one outage run and returns its report; an error means the run
// itself could not be carried out (a process would not start), not that an invariant
// failed.
func RunOutage(ctx context.Context, cfg OutageConfig) (*OutageReport, error) {
	if cfg.Bin == "" || cfg.Dir == "" {
		return nil, errors.New("chaos: Bin and Dir are required")
	}
	cfg.withDefaults()
	base := Config{Bin: cfg.Bin, Dir: cfg.Dir, Seed: cfg.Seed, Duration: cfg.loadDuration(), Clients: cfg.Clients,
		Think: cfg.Think, PoisonRate: cfg.PoisonRate, DrainTimeout: cfg.DrainTimeout, Log: cfg.Log}
	spec := setupSpec{
		workers: cfg.Workers,
		metrics: true,
		llmArgs: []string{"--latency", cfg.ModelLatency.String(), "--max-input-chars", fmt.Sprint(maxInput), "--seed", fmt.Sprint(cfg.Seed)},
		settings: []string{
			"ONCEFLOW_WORKER_CONCURRENCY=64",
			"ONCEFLOW_CLAIM_IDLE=" + cfg.ClaimIdle.String(), fmt.Sprintf("ONCEFLOW_MAX_DELIVERIES=%d", cfg.MaxDeliveries),
			"ONCEFLOW_SHUTDOWN_TIMEOUT=" + cfg.ShutdownTimeout.String(),
			// A model call takes ModelLatency: its timeout and the job's budget leave
			// room for it and a few retries.
			"ONCEFLOW_LLM_TIMEOUT=" + (2 * cfg.ModelLatency).String(), "ONCEFLOW_JOB_BUDGET=" + (4 * cfg.ModelLatency).String(),
			"ONCEFLOW_LEDGER_LEASE=" + (2 * cfg.ModelLatency).String(),
			"ONCEFLOW_RELAY_INTERVAL=100ms", "ONCEFLOW_RELAY_LEASE=3s", "ONCEFLOW_STATS_INTERVAL=1s",
		},
	}
	o := &outageRun{run: newRun(base, spec), ocfg: cfg}
	defer o.stopAll()
	if err := o.setup(ctx); err != nil {
		return nil, err
	}
	settings := fmt.Sprintf("ClaimIdle %s, MaxDeliveries %d, %d workers (SIGTERM restarts every %s, shutdown timeout %s), "+
		"model calls %s, %d clients (think %s, %.0f%% poison)", cfg.ClaimIdle, cfg.MaxDeliveries, cfg.Workers, cfg.RestartEvery,
		cfg.ShutdownTimeout, cfg.ModelLatency, cfg.Clients, cfg.Think, 100*cfg.PoisonRate)
	o.logf("seed %d: %s; load for %s or more", cfg.Seed, settings, cfg.loadDuration())

	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	wait := o.startClients(loadCtx)
	restartCtx, stopRestarts := context.WithCancel(ctx)
	var restarts sync.WaitGroup
	restarts.Go(func() { o.rollingRestarts(restartCtx) })

	o.beginPhase("baseline", "baseline: load and rolling restarts only", 0)
	err := o.outages(ctx)
	stopLoad()
	stopRestarts()
	restarts.Wait()
	if err != nil {
		return nil, err
	}
	if err := o.ensureRunning(ctx); err != nil {
		return nil, err
	}
	wait()
	loadEnd := time.Now()
	o.logf("load stopped; %d jobs accepted; draining", o.acceptedCount())
	eff, drained, err := o.drain(ctx)
	if err != nil {
		return nil, err
	}
	rep := o.check(ctx, eff)
	rep.Settings = settings
	if drained {
		rep.Drained = time.Since(loadEnd)
	} else {
		rep.Drained = -1
	}
	rep.Duration = time.Since(o.start).Round(time.Second)
	return rep, nil
}

func (o *outageRun) sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

func (o *outageRun) acceptedCount() int {
	o.jobsMu.Lock()
	defer o.jobsMu.Unlock()
	return len(o.accepted)
}

func (o *outageRun) beginPhase(name, what string, length time.Duration) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.phases = append(o.phases, PhaseReport{Name: name, What: what, Start: time.Since(o.start).Round(100 * time.Millisecond),
		Outage: length, Drained: -1, Seen: Observation{FirstNamed: -1, FirstOpen: -1}})
	o.starts = append(o.starts, time.Now())
	return len(o.phases) - 1
}

// outages runs the three outages in turn after Gap of plain load, polling the workers
// while each lasts, then timing its backlog's drain while the load goes on for at least
// Gap and until the backlog is done.
func (o *outageRun) outages(ctx context.Context) error {
	c := o.ocfg
	list := []outage{
		{dep: "postgres", what: "PostgreSQL stopped (fast shutdown)", length: c.Postgres,
			begin: func(context.Context) error { o.pg.Down(); return nil },
			end:   func(context.Context) error { return o.pg.Up() }},
		{dep: "llm", what: "model answers 503 to everything", length: c.Model,
			begin: func(ctx context.Context) error { return fakeserver.SetFault(ctx, nil, o.llmURL, fakeserver.Fault503) },
			end:   func(ctx context.Context) error { return fakeserver.SetFault(ctx, nil, o.llmURL, fakeserver.FaultNone) }},
		{dep: "redis", what: "Redis stopped (SIGTERM)", length: c.Redis,
			begin: func(context.Context) error { o.redis.Down(); return nil },
			end:   func(context.Context) error { return o.redis.Up() }},
	}
	if err := o.sleep(ctx, c.Gap); err != nil {
		return err
	}
	for _, out := range list {
		i := o.beginPhase(out.dep, out.what, out.length)
		o.event("outage begins: %s for %s", out.what, out.length)
		if err := out.begin(ctx); err != nil {
			return fmt.Errorf("begin outage %s: %w", out.dep, err)
		}
		pollCtx, stopPoll := context.WithTimeout(ctx, out.length)
		o.poll(pollCtx, i, out.dep)
		stopPoll()
		if err := out.end(ctx); err != nil {
			return fmt.Errorf("end outage %s: %w", out.dep, err)
		}
		o.event("outage ends: %s", out.dep)
		ended := time.Now()
		backlog := o.acceptedBefore(ended)
		done := make(chan struct{})
		go func() { defer close(done); o.timeDrain(ctx, i, ended, backlog) }()
		if err := o.sleep(ctx, c.Gap); err != nil {
			return err
		}
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// acceptedBefore returns the non-poison jobs accepted before t.
func (o *outageRun) acceptedBefore(t time.Time) []string {
	o.jobsMu.Lock()
	defer o.jobsMu.Unlock()
	var ids []string
	for id, at := range o.acceptedAt {
		if !at.After(t) && !o.poison[id] {
			ids = append(ids, id)
		}
	}
	return ids
}

// timeDrain waits until every job of backlog has a summary or a dead letter, and
// records the time since ended in phase i (or leaves -1 after DrainTimeout).
func (o *outageRun) timeDrain(ctx context.Context, i int, ended time.Time, backlog []string) {
	deadline := ended.Add(o.ocfg.DrainTimeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if o.accountedFor(ctx, backlog) {
			took := time.Since(ended)
			o.mu.Lock()
			o.phases[i].Drained = took
			name := o.phases[i].Name
			o.mu.Unlock()
			o.logf("backlog of the %s outage (%d jobs) done after %s", name, len(backlog), took.Round(100*time.Millisecond))
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// accountedFor reports whether every job of ids has a summary or a dead letter (false
// when a store does not answer).
func (o *outageRun) accountedFor(ctx context.Context, ids []string) bool {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	done, err := o.summaryCounts(qctx)
	if err != nil {
		return false
	}
	letters, err := o.deadLetters(qctx)
	if err != nil {
		return false
	}
	dead := map[string]bool{}
	for _, d := range letters {
		dead[d.JobID] = true
	}
	for _, id := range ids {
		if done[id] == 0 && !dead[id] {
			return false
		}
	}
	return true
}

// rollingRestarts sends SIGTERM to one worker after the other every RestartEvery
// until ctx ends, and starts each again once it exited.
func (o *outageRun) rollingRestarts(ctx context.Context) {
	limit := o.ocfg.ShutdownTimeout + 10*time.Second
	next := time.Now()
	for n := 0; ; n++ {
		// On a fixed cadence: a restart that took long does not push the next ones back.
		next = next.Add(o.ocfg.RestartEvery)
		if o.sleep(ctx, time.Until(next)) != nil {
			return
		}
		w := o.workers[n%len(o.workers)]
		t0 := time.Now()
		code := w.Stop(limit)
		took := time.Since(t0)
		o.mu.Lock()
		o.restarts++
		if code != 0 || took >= limit {
			o.badExits = append(o.badExits, fmt.Sprintf("%s exited %d after %s", w.Name, code, took.Round(100*time.Millisecond)))
		}
		o.mu.Unlock()
		if err := w.Start(); err != nil {
			o.event("restart %s: %v", w.Name, err)
			continue
		}
		o.event("SIGTERM %s: exited %d after %s; restarted", w.Name, code, took.Round(100*time.Millisecond))
	}
}

// breakerOpen matches the metric line of an open breaker; its one group is the
// dependency.
var breakerOpen = regexp.MustCompile(`^onceflow_breaker_open\{[^}]*dependency="([^"]+)"[^}]*\} 1(\.0+)?$`)

// poll reads every worker's /readyz and /metrics every PollEvery until ctx ends, and
// records in phase i whether they named dep.
func (o *outageRun) poll(ctx context.Context, i int, dep string) {
	hc := &http.Client{Timeout: 3 * time.Second}
	began := o.starts[i]
	for {
		for _, base := range o.workerURLs {
			var ready struct {
				Checks map[string]string `json:"checks"`
			}
			readyErr := getJSONStatus(ctx, hc, base+"/readyz", &ready)
			open, metricErr := metricOpen(ctx, hc, base+"/metrics", dep)
			o.mu.Lock()
			seen := &o.phases[i].Seen
			if readyErr == nil {
				seen.Polls++
				if check, ok := ready.Checks[dep]; ok && check != "ok" {
					seen.Named++
					if seen.FirstNamed < 0 {
						seen.FirstNamed, seen.Sample = time.Since(began), dep+": "+check
					}
				}
			}
			if metricErr == nil {
				seen.MetricPolls++
				if open {
					seen.MetricOpen++
					if seen.FirstOpen < 0 {
						seen.FirstOpen = time.Since(began)
					}
				}
			}
			o.mu.Unlock()
		}
		if o.sleep(ctx, o.ocfg.PollEvery) != nil {
			return
		}
	}
}

// getJSONStatus decodes the JSON body of url whatever its status (/readyz answers 503
// when a dependency is down).
func getJSONStatus(ctx context.Context, hc *http.Client, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(v)
}

// metricOpen reports whether the /metrics at url has onceflow_breaker_open 1 for dep.
func metricOpen(ctx context.Context, hc *http.Client, url, dep string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	open := false
	for sc.Scan() {
		if m := breakerOpen.FindStringSubmatch(sc.Text()); m != nil && m[1] == dep {
			open = true
		}
	}
	return open, sc.Err()
}

// outageEffects is what drain collected.
type outageEffects struct {
	audit     *summaries.Report
	sink      sinkStats
	summaries map[string]int
	delivered map[string]int
	dead      []queue.DeadLetter
}

// collect reads the audit, the sink's deliveries, the summaries and the dead letters.
func (o *outageRun) collect(ctx context.Context) (*outageEffects, error) {
	a, err := o.audit(ctx)
	if err != nil {
		return nil, err
	}
	var sink sinkStats
	if err := getJSON(ctx, o.sinkURL+"/?deliveries=1", &sink); err != nil {
		return nil, err
	}
	done, err := o.summaryCounts(ctx)
	if err != nil {
		return nil, err
	}
	dead, err := o.deadLetters(ctx)
	if err != nil {
		return nil, err
	}
	return &outageEffects{audit: a, sink: sink, summaries: done, delivered: deliveriesByJob(sink), dead: dead}, nil
}

// drain waits until every accepted job has a summary or a dead letter, nothing is
// pending or unsent and every summary has its delivery, or DrainTimeout; drained says
// which.
func (o *outageRun) drain(ctx context.Context) (eff *outageEffects, drained bool, err error) {
	deadline := time.Now().Add(o.ocfg.DrainTimeout)
	o.jobsMu.Lock()
	ids := slices.Collect(maps.Values(o.accepted))
	o.jobsMu.Unlock()
	for {
		if eff, err = o.collect(ctx); err != nil {
			return nil, false, err
		}
		dead := map[string]bool{}
		for _, d := range eff.dead {
			dead[d.JobID] = true
		}
		left := 0
		for _, id := range ids {
			if eff.summaries[id] == 0 && !dead[id] {
				left++
			}
		}
		undelivered := 0
		for id := range eff.summaries {
			if eff.delivered[id] == 0 {
				undelivered++
			}
		}
		a := eff.audit
		drained = left == 0 && undelivered == 0 && a.OutboxUnsent == 0 && a.StreamPending == 0
		o.logf("drain: %d jobs without a summary or a dead letter, unsent %d, pending %d, dead %d, summaries without delivery %d",
			left, a.OutboxUnsent, a.StreamPending, a.DLQ, undelivered)
		if drained || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(time.Second)
	}
	// One more look once quiet, so a row sent a moment ago is not reported as unsent.
	time.Sleep(500 * time.Millisecond)
	eff, err = o.collect(ctx)
	return eff, drained, err
}

// phaseOf returns the phase in which t falls (the last one after the load).
func (o *outageRun) phaseOf(t time.Time) int {
	i := 0
	for j, s := range o.starts {
		if !t.Before(s) {
			i = j
		}
	}
	return i
}

// check checks the invariants of an outage run: only the poison jobs are
// dead-lettered, for a permanent reason; every other accepted job has exactly one
// summary and exactly one delivery; audit is clean; each outage was named by /readyz
// and the breaker metric while it lasted; every SIGTERM ended in exit 0 in time.
func (o *outageRun) check(ctx context.Context, eff *outageEffects) *OutageReport {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.jobsMu.Lock()
	defer o.jobsMu.Unlock()
	rep := &OutageReport{Seed: o.cfg.Seed, Phases: o.phases, Accepted: len(o.accepted), Poison: len(o.poison),
		Summaries: eff.audit.Summaries, DeadByReason: map[string]int{}, Deliveries: eff.sink.Deliveries,
		Restarts: o.restarts, BadExits: len(o.badExits)}
	o.evMu.Lock()
	rep.Events = slices.Clone(o.events)
	o.evMu.Unlock()
	violate := func(format string, args ...any) {
		rep.Violations = append(rep.Violations, fmt.Sprintf(format, args...))
	}
	for _, v := range eff.audit.Violations {
		violate("audit: %s", v)
	}
	if len(o.mismatch) > 0 {
		violate("keys answered with two job ids: %s", clip(o.mismatch))
	}
	if len(o.rejected) > 0 {
		violate("requests refused with a 4xx: %s", clip(o.rejected))
	}
	if eff.audit.OutboxExhausted != 0 {
		violate("%d outbox rows exhausted", eff.audit.OutboxExhausted)
	}
	if len(o.badExits) > 0 {
		violate("workers that did not exit 0 within the shutdown timeout after SIGTERM (%d): %s", len(o.badExits), clip(o.badExits))
	}

	for i := range rep.Phases {
		rep.Phases[i].DeadByReason = map[string]int{}
	}
	for id, at := range o.acceptedAt {
		p := &rep.Phases[o.phaseOf(at)]
		p.Accepted++
		if o.poison[id] {
			p.Poison++
		}
		p.DuplicateSummaries += max(0, eff.summaries[id]-1)
		p.DuplicateDeliveries += max(0, eff.delivered[id]-1)
	}
	deadReasons := map[string][]string{}
	wrongDead := map[string][]string{} // reason -> non-poison job ids
	for _, d := range eff.dead {
		reason := deadReason(d.Reason)
		rep.DeadLettered++
		rep.DeadByReason[reason]++
		rep.Phases[o.phaseOf(d.FailedAt)].DeadByReason[reason]++
		deadReasons[d.JobID] = append(deadReasons[d.JobID], reason)
		if !o.poison[d.JobID] {
			wrongDead[reason] = append(wrongDead[reason], d.JobID)
		}
	}
	var noSummary, twoSummaries, noEmail, twoEmails, notDead, poisonOtherReason []string
	for id := range o.acceptedAt {
		switch {
		case o.poison[id]:
			switch rs := deadReasons[id]; {
			case len(rs) == 0:
				notDead = append(notDead, id)
			case slices.ContainsFunc(rs, func(r string) bool { return r != "permanent" }):
				poisonOtherReason = append(poisonOtherReason, id+" ("+strings.Join(rs, ", ")+")")
			}
		case eff.summaries[id] == 0:
			noSummary = append(noSummary, id)
		case eff.summaries[id] > 1:
			twoSummaries = append(twoSummaries, id)
		case eff.delivered[id] == 0:
			noEmail = append(noEmail, id)
		case eff.delivered[id] > 1:
			twoEmails = append(twoEmails, fmt.Sprintf("%s (%d)", id, eff.delivered[id]))
		}
		rep.DuplicateSummaries += max(0, eff.summaries[id]-1)
		rep.DuplicateDeliveries += max(0, eff.delivered[id]-1)
	}
	var strayEmail, summaryNoEmail []string
	for id := range eff.delivered {
		if eff.summaries[id] == 0 {
			strayEmail = append(strayEmail, id)
		}
	}
	for id := range eff.summaries {
		if eff.delivered[id] == 0 {
			summaryNoEmail = append(summaryNoEmail, id)
		}
	}
	for _, reason := range slices.Sorted(maps.Keys(wrongDead)) {
		ids := wrongDead[reason]
		slices.Sort(ids)
		violate("dead-lettered jobs that were not poison, reason %q (%d): %s", reason, len(ids), clip(ids))
	}
	for _, c := range []struct {
		ids  []string
		what string
	}{
		{noSummary, "accepted jobs without a summary"},
		{twoSummaries, "jobs with more than one summary"},
		{noEmail, "accepted jobs without a delivered email"},
		{twoEmails, "jobs whose email was delivered more than once"},
		{summaryNoEmail, "summaries without a delivered email"},
		{strayEmail, "emails without a summary"},
		{notDead, "poison jobs not dead-lettered"},
		{poisonOtherReason, "poison jobs dead-lettered for another reason than permanent"},
	} {
		if len(c.ids) > 0 {
			slices.Sort(c.ids)
			violate("%s (%d): %s", c.what, len(c.ids), clip(c.ids))
		}
	}
	for _, p := range rep.Phases {
		if p.Outage == 0 {
			continue
		}
		if p.Seen.Named == 0 {
			violate("%s outage: /readyz never named %q as unavailable or degraded (%d answered polls)", p.Name, p.Name, p.Seen.Polls)
		}
		if p.Seen.MetricOpen == 0 {
			violate("%s outage: /metrics never showed onceflow_breaker_open{dependency=%q} 1 (%d answered polls)", p.Name, p.Name, p.Seen.MetricPolls)
		}
		if p.Drained < 0 {
			violate("%s outage: the jobs accepted before its end were not all done within %s of it", p.Name, o.ocfg.DrainTimeout)
		}
	}

	var llm struct {
		Requests int64 `json:"requests"`
	}
	if err := getJSON(ctx, o.llmURL+"/stats", &llm); err == nil {
		rep.ModelRequests = llm.Requests
	}
	for _, w := range o.workers {
		rep.HandedBack += w.CountLog("a dependency is down: job handed back without spending a delivery")
	}
	return rep
}
