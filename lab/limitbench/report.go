package limitbench

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Report is what a benchmark measured.
type Report struct {
	// Config is the benchmark's configuration, defaults applied.
	Config Config
	// Texts describes the jobs' prompts and their token costs.
	Texts TextStats
	// Goodput are the goodput runs, in the order they ran.
	Goodput []*GoodputResult
	// Fairness is the fairness run, nil when it did not run.
	Fairness *FairnessResult
	// CPUs is the machine's logical CPUs, which every process of the benchmark
	// (Redis, PostgreSQL, fake-llm, the workers, the benchmark) shares.
	CPUs int
	// Started is when the benchmark started.
	Started time.Time
}

// Usage is what one run's processes spent and what the machine did meanwhile.
type Usage struct {
	// RedisCPU is the CPU time of the run's redis-server (INFO cpu) from the workers'
	// start to the end of the run; WorkersCPU that of the work processes together;
	// LLMCPU fake-llm's (over its whole life).
	RedisCPU, WorkersCPU, LLMCPU time.Duration
	// RedisCommands counts the commands the run's redis-server processed over the same
	// time (INFO stats total_commands_processed: a script's calls count one each).
	RedisCommands int64
	// LoadStart and LoadEnd are the machine's 1-minute load average then.
	LoadStart, LoadEnd float64
}

// Model is what fake-llm's GET /stats said at the end of a run.
type Model struct {
	// Requests counts model requests; OK those answered 200; Limited those answered
	// 429 (rate limited); Other the rest.
	Requests, OK, Limited, Other int64
	// KeysMax is the most requests one Idempotency-Key (one job's call) took.
	KeysMax int64
}

// LimitedShare is the share of requests answered 429.
func (m Model) LimitedShare() float64 { return ratio(float64(m.Limited), float64(m.Requests)) }

// GoodputResult is one goodput run.
type GoodputResult struct {
	// Name is the run's name (RunConfigured, RunLearnt, RunOff).
	Name string
	// Admission and Configured are the run's settings; Tenants the number of tenants
	// its backlog came from (interleaved).
	Admission, Configured bool
	Tenants               int
	// Jobs is the backlog; Summarised the jobs with a summary row at the end; Outbox the
	// outbox rows; DeadLetters the jobs dead-lettered.
	Jobs, Summarised, Outbox, DeadLetters int64
	// Complete reports that every job was summarised or dead-lettered within the run's
	// time.
	Complete bool
	// Wall is from the workers' start to the last summary's commit.
	Wall time.Duration
	// Boot is from the workers' start until all of them logged "worker started".
	Boot time.Duration
	// FirstMinute is the start left out of the steady state (Config.FirstMinute).
	FirstMinute time.Duration
	// Done are the times of the summaries' commits (summaries.created_at) from the
	// workers' start, sorted: each follows its job's successful model call by
	// milliseconds, and times it.
	Done []time.Duration
	// TenantLast is each tenant's last summary, from the workers' start.
	TenantLast map[string]time.Duration
	// Model is fake-llm's view.
	Model Model
	// DuplicateRuns counts deliveries that found the summary already stored (the
	// workers' logs): extra runs, not extra effects.
	DuplicateRuns int
	// Metrics are the work processes' /metrics at the end, summed.
	Metrics Metrics
	// Usage is the CPU the run cost.
	Usage Usage
	// DeadReasons are the first dead letters' job ids and reasons.
	DeadReasons []string
	// RPM is the provider's limit, the denominator of goodput.
	RPM int
}

// SteadyCalls returns the successful calls after FirstMinute and the window they took:
// from FirstMinute to the last one.
func (g *GoodputResult) SteadyCalls() (int, time.Duration) { return steady(g.Done, g.FirstMinute) }

// SteadyRPM returns the successful calls per minute over the steady state, 0 when the
// run had none (it ended within the first minute, or did nothing after it).
func (g *GoodputResult) SteadyRPM() float64 {
	n, w := g.SteadyCalls()
	return ratio(float64(n), w.Minutes())
}

// Goodput returns SteadyRPM divided by the provider's requests per minute.
func (g *GoodputResult) Goodput() float64 { return ratio(g.SteadyRPM(), float64(g.RPM)) }

// WholeRPM returns the successful calls per minute over the whole run, the first
// minute's burst included.
func (g *GoodputResult) WholeRPM() float64 {
	return ratio(float64(len(g.Done)), g.Wall.Minutes())
}

// IdealWall returns the shortest time the provider's limit allows for the backlog: a
// minute's worth at once (its bucket starts full), the rest at RPM.
func (g *GoodputResult) IdealWall() time.Duration {
	rest := max(g.Jobs-int64(g.RPM), 0)
	return time.Duration(float64(rest) * float64(time.Minute) / float64(g.RPM))
}

// SummarisedTwice returns the successful model answers beyond one per summarised job:
// jobs the provider summarised (and billed) more than once.
func (g *GoodputResult) SummarisedTwice() int64 { return max(g.Model.OK-g.Summarised, 0) }

// steady counts the times after from and returns them with the window from from to the
// last of them (0 when none is after from). times must be sorted.
func steady(times []time.Duration, from time.Duration) (int, time.Duration) {
	i, _ := slices.BinarySearch(times, from+1)
	n := len(times) - i
	if n == 0 {
		return 0, 0
	}
	return n, times[len(times)-1] - from
}

// FairnessResult is the fairness run.
type FairnessResult struct {
	// Backlog is the first tenant's jobs, queued before the workers started; Late the
	// second tenant's, queued Warmup after.
	Backlog, Late int
	Warmup        time.Duration
	// Complete reports that every late job was summarised within the run's time.
	Complete bool
	// LateDone counts the late jobs summarised; First and Last are the first and last of
	// them, from their enqueue.
	LateDone    int
	First, Last time.Duration
	// FairShare is the late jobs' time at half the provider's requests per minute.
	FairShare time.Duration
	// BacklogDuring counts the first tenant's jobs summarised from the late jobs'
	// enqueue to the last of them.
	BacklogDuring int64
	// ProviderLeft is what fake-llm's requests bucket held just before the late jobs
	// were queued: the x-ratelimit-remaining-requests of one probe request (excluded
	// from Model), plus the one it took when answered 200; -1 when unknown. Capacity the backlog left unused accumulates there,
	// and the late jobs may spend it at once.
	ProviderLeft int64
	// Summarised counts the summary rows at the end; DeadLetters the jobs dead-lettered.
	Summarised, DeadLetters int64
	// DeadReasons are the first dead letters' job ids and reasons.
	DeadReasons []string
	// Model is fake-llm's view at the end.
	Model Model
	// Metrics are the work processes' /metrics at the end, summed.
	Metrics Metrics
	// Usage is the CPU the run cost.
	Usage Usage
	// RPM is the provider's limit.
	RPM int
}

// Ratio returns the late jobs' time divided by their fair-share time (0 when they did
// not all finish).
func (f *FairnessResult) Ratio() float64 {
	if !f.Complete {
		return 0
	}
	return ratio(f.Last.Seconds(), f.FairShare.Seconds())
}

// Violations returns the targets missed and the invariants broken, one sentence each:
// with admission on, goodput below TargetGoodput, 429s above TargetLimitedShare, a job
// left undone or dead-lettered; in every run, a job summarised twice or an outbox row
// missing or extra; in the fairness run, the late jobs over TargetFairness times their
// fair share. The baseline (admission off) is held only to the invariants.
func (r *Report) Violations() []string {
	var v []string
	for _, g := range r.Goodput {
		if n := g.SummarisedTwice(); n > 0 {
			v = append(v, fmt.Sprintf("%s: %d successful model answers beyond one per summarised job", g.Name, n))
		}
		if g.Outbox != g.Summarised {
			v = append(v, fmt.Sprintf("%s: %d outbox rows for %d summaries", g.Name, g.Outbox, g.Summarised))
		}
		if !g.Admission {
			continue
		}
		if !g.Complete || g.Summarised != g.Jobs {
			v = append(v, fmt.Sprintf("%s: %d of %d jobs summarised (%d dead-lettered)", g.Name, g.Summarised, g.Jobs, g.DeadLetters))
		}
		if g.DeadLetters > 0 {
			v = append(v, fmt.Sprintf("%s: %d jobs dead-lettered", g.Name, g.DeadLetters))
		}
		if gp := g.Goodput(); gp < TargetGoodput {
			v = append(v, fmt.Sprintf("%s: goodput %.3f, target ≥ %.2f", g.Name, gp, TargetGoodput))
		}
		if s := g.Model.LimitedShare(); s > TargetLimitedShare {
			v = append(v, fmt.Sprintf("%s: %.2f%% of model requests answered 429, target ≤ %.0f%%", g.Name, 100*s, 100*TargetLimitedShare))
		}
	}
	if f := r.Fairness; f != nil {
		switch {
		case !f.Complete:
			v = append(v, fmt.Sprintf("fairness: only %d of %d late jobs summarised", f.LateDone, f.Late))
		case f.Ratio() > TargetFairness:
			v = append(v, fmt.Sprintf("fairness: the late tenant's %d jobs took %.1fs, %.2f× their fair share of %.1fs, target ≤ %.0f×",
				f.Late, f.Last.Seconds(), f.Ratio(), f.FairShare.Seconds(), TargetFairness))
		}
		if f.DeadLetters > 0 {
			v = append(v, fmt.Sprintf("fairness: %d jobs dead-lettered", f.DeadLetters))
		}
		if n := max(f.Model.OK-f.Summarised, 0); n > 0 {
			v = append(v, fmt.Sprintf("fairness: %d successful model answers beyond one per summarised job", n))
		}
	}
	return v
}

// Failed reports whether a target was missed or an invariant broken.
func (r *Report) Failed() bool { return len(r.Violations()) > 0 }

// String renders the report as Markdown: the set-up, the goodput table, the ratios of
// admission on to off, the limiter's and the queue's counters, the fairness run, and
// the verdict.
func (r *Report) String() string {
	var b strings.Builder
	c := r.Config
	fmt.Fprintf(&b, "Run %s on %d logical CPUs shared by Redis, PostgreSQL, fake-llm, the workers and the benchmark.\n",
		r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.CPUs)
	fmt.Fprintf(&b, "Set-up: fake-llm --rpm %d --tpm %d --latency %v (a fresh process per run); %d × `onceflow work` × ONCEFLOW_WORKER_CONCURRENCY=%d; "+
		"%d jobs queued before the workers start", c.RPM, c.TPM, c.Latency, c.Workers, c.Concurrency, c.Jobs)
	fmt.Fprintf(&b, " (goodput runs: from %d tenants, interleaved, unless the run says one).\n", c.Tenants)
	t := r.Texts
	fmt.Fprintf(&b, "Texts: %.0f characters on average; charged %.0f tokens at admission (prompt estimate + 1024 output), %.0f once corrected to usage; "+
		"at %d requests/min that is %.0f tokens/min (%.0f%% of the %d TPM), and %.0f tokens/min if every call kept its admission charge.\n\n",
		t.MeanChars, t.MeanEstimate, t.MeanUsage, c.RPM, t.MeanUsage*float64(c.RPM), 100*t.MeanUsage*float64(c.RPM)/float64(c.TPM), c.TPM,
		t.MeanEstimate*float64(c.RPM))
	if len(r.Goodput) > 0 {
		b.WriteString("| run | wall time (ideal) | successful calls/min, steady (after 1st min) | goodput | calls/min, whole run | model requests | 429s | 429 share | requests/job | dead letters | summarised twice | failed runs (attempts spent) | snoozed runs |\n")
		b.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, g := range r.Goodput {
			wall := "incomplete"
			if g.Complete {
				wall = fmt.Sprintf("%.1f s (%.0f s)", g.Wall.Seconds(), g.IdealWall().Seconds())
			}
			n, w := g.SteadyCalls()
			fmt.Fprintf(&b, "| %s | %s | %.1f (%d in %.1f s) | **%.3f** | %.1f | %d | %d | **%.2f%%** | %.2f | %d | %d | %.0f | %.0f |\n",
				runLabel(g), wall, g.SteadyRPM(), n, w.Seconds(), g.Goodput(), g.WholeRPM(), g.Model.Requests, g.Model.Limited,
				100*g.Model.LimitedShare(), ratio(float64(g.Model.Requests), float64(g.Jobs)), g.DeadLetters, g.SummarisedTwice(),
				g.Metrics.FailedRuns(), g.Metrics.Sum("onceflow_queue_snoozed_total"))
		}
		b.WriteString("\n")
		r.writeRatios(&b)
		r.writeCounters(&b)
	}
	if f := r.Fairness; f != nil {
		fmt.Fprintf(&b, "Fairness (admission on, limits configured): %d jobs of tenant-a queued, workers started, %d jobs of tenant-b queued %v later.\n\n",
			f.Backlog, f.Late, f.Warmup)
		b.WriteString("| late jobs | first done | last done | fair share (½ of the RPM) | ratio | provider's requests left at their enqueue | tenant-a jobs done meanwhile | calls/min meanwhile | 429s (whole run) | dead letters |\n")
		b.WriteString("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		last := "not all done"
		if f.Complete {
			last = fmt.Sprintf("%.2f s", f.Last.Seconds())
		}
		left := "unknown"
		if f.ProviderLeft >= 0 {
			left = fmt.Sprint(f.ProviderLeft)
		}
		fmt.Fprintf(&b, "| %d/%d | %.2f s | %s | %.1f s | **%.2f×** | %s | %d | %.0f | %d of %d | %d |\n\n",
			f.LateDone, f.Late, f.First.Seconds(), last, f.FairShare.Seconds(), f.Ratio(), left, f.BacklogDuring,
			ratio(float64(f.BacklogDuring+int64(f.LateDone)), f.Last.Minutes()), f.Model.Limited, f.Model.Requests, f.DeadLetters)
		fmt.Fprintf(&b, "Limiter in the fairness run: put off %s; CPU: redis %.1f s, workers %.1f s.\n\n",
			f.Metrics.Deferred(), f.Usage.RedisCPU.Seconds(), f.Usage.WorkersCPU.Seconds())
	}
	for _, g := range r.Goodput {
		for _, d := range g.DeadReasons {
			fmt.Fprintf(&b, "Dead letter of the %s run: %s\n", g.Name, d)
		}
	}
	if f := r.Fairness; f != nil {
		for _, d := range f.DeadReasons {
			fmt.Fprintf(&b, "Dead letter of the fairness run: %s\n", d)
		}
	}
	if v := r.Violations(); len(v) > 0 {
		b.WriteString("TARGETS MISSED OR INVARIANTS BROKEN:\n")
		for _, s := range v {
			fmt.Fprintf(&b, "- %s\n", s)
		}
	} else {
		b.WriteString("Every target met and every invariant held.\n")
	}
	return b.String()
}

// writeRatios writes each admission-on run beside the baseline.
func (r *Report) writeRatios(b *strings.Builder) {
	var off *GoodputResult
	for _, g := range r.Goodput {
		if !g.Admission {
			off = g
		}
	}
	if off == nil || !off.Complete {
		return
	}
	b.WriteString("| admission on ÷ off | wall time | steady calls/min | model requests | 429s | worker CPU | redis CPU | redis commands |\n")
	b.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, g := range r.Goodput {
		if !g.Admission || !g.Complete {
			continue
		}
		fmt.Fprintf(b, "| %s | %.2f | %.2f | %.2f | %.4f | %.2f | %.2f | %.2f |\n", runLabel(g),
			ratio(g.Wall.Seconds(), off.Wall.Seconds()), ratio(g.SteadyRPM(), off.SteadyRPM()),
			ratio(float64(g.Model.Requests), float64(off.Model.Requests)), ratio(float64(g.Model.Limited), float64(off.Model.Limited)),
			ratio(g.Usage.WorkersCPU.Seconds(), off.Usage.WorkersCPU.Seconds()), ratio(g.Usage.RedisCPU.Seconds(), off.Usage.RedisCPU.Seconds()),
			ratio(float64(g.Usage.RedisCommands), float64(off.Usage.RedisCommands)))
	}
	b.WriteString("\n")
}

// writeCounters writes, per goodput run, what the workers' metrics and the machine say.
func (r *Report) writeCounters(b *strings.Builder) {
	b.WriteString("| run | put off by the limiter, by reason (per job) | 429s the workers got | fleet pauses | in-process model retries | mean in-process admission wait | model breaker trips / jobs handed back for it | tenants' last job | duplicate runs | CPU s: redis / workers / fake-llm | redis commands per job | load avg start → end |\n")
	b.WriteString("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |\n")
	for _, g := range r.Goodput {
		var last []string
		for _, k := range slices.Sorted(maps.Keys(g.TenantLast)) {
			last = append(last, fmt.Sprintf("%s %.0f s", k, g.TenantLast[k].Seconds()))
		}
		m := g.Metrics
		deferred, pauses, wait := "— (no limiter)", "—", "—"
		if g.Admission {
			deferred = fmt.Sprintf("%s (%.2f)", m.Deferred(), ratio(m.Sum("onceflow_llm_admission_deferred_total"), float64(g.Jobs)))
			pauses = fmt.Sprintf("%.0f", m.Sum("onceflow_llm_pauses_total"))
			wait = fmt.Sprintf("%.0f ms", 1000*ratio(m.Sum("onceflow_llm_admission_wait_seconds_sum"), m.Sum("onceflow_llm_admission_wait_seconds_count")))
		}
		fmt.Fprintf(b, "| %s | %s | %.0f | %s | %.0f | %s | %.0f / %.0f | %s | %d | %.1f / %.1f / %.1f | %.0f | %.1f → %.1f |\n", runLabel(g), deferred,
			m.By("onceflow_llm_calls_total", "outcome")["rate_limited"], pauses, m.Sum("onceflow_llm_retries_total"), wait,
			m.By("onceflow_breaker_trips_total", "dependency")["llm"], m.Sum("onceflow_queue_handed_back_total"), strings.Join(last, ", "), g.DuplicateRuns, g.Usage.RedisCPU.Seconds(), g.Usage.WorkersCPU.Seconds(), g.Usage.LLMCPU.Seconds(),
			ratio(float64(g.Usage.RedisCommands), float64(g.Jobs)), g.Usage.LoadStart, g.Usage.LoadEnd)
	}
	b.WriteString("\n")
}

func runLabel(g *GoodputResult) string {
	tenants := ""
	if g.Tenants == 1 {
		tenants = ", one tenant"
	}
	switch {
	case !g.Admission:
		return "admission off (baseline)" + tenants
	case g.Configured:
		return "admission on, RPM/TPM configured" + tenants
	}
	return "admission on, learnt from headers" + tenants
}

// ratio is a/b, 0 when b is 0.
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
