// Package limitbench measures the provider admission control (package
// limiter) with real processes: `onceflow fake-llm --rpm --tpm`, which enforces
// per-model limits the way OpenAI does (token buckets that start full with a minute's
// worth and refill continuously; 429 with Retry-After and x-ratelimit-* headers),
// several `onceflow work` processes running the summaries workflow through the OpenAI
// adapter, a redis-server of each run's own (appendfsync always, like the dev server)
// and a fresh schema per run on the PostgreSQL named by Config.DatabaseURL.
//
// A goodput run queues Config.Jobs summaries jobs from Config.Tenants tenants,
// interleaved (job i belongs to tenant i mod Tenants), before the workers start, and
// times them until every job is summarised (or dead-lettered). It runs four ways:
// admission on with the limits configured (ONCEFLOW_LLM_RPM, ONCEFLOW_LLM_TPM); the
// same with the whole backlog from one tenant (what the tenants' lines cost);
// admission on with nothing configured (the limiter learns the limits from the
// provider's headers); and admission off, the baseline. Every run gets a fresh
// fake-llm process, so the provider's buckets start full.
//
// The fairness run (admission on, limits configured) queues Config.Jobs jobs of one
// tenant, starts the workers, waits Config.FairnessWarmup, then queues
// Config.FairnessJobs jobs of a second tenant and times them from their enqueue to
// their last summary, against their fair share (half the requests per minute).
//
// Run returns a Report; its String is the Markdown the benchmark prints. Nothing is
// written into the repository: `make bench-limits` (TestLimitsBench, gated by
// ONCEFLOW_LIMITS_BENCH=1) prints the report, and docs/BENCHMARKS.md records one run's
// figures by hand.
package limitbench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/summaries"
)

// Defaults of Config's fields: the load of the published figures (docs/BENCHMARKS.md).
const (
	DefaultJobs           = 2000
	DefaultTenants        = 3
	DefaultWorkers        = 4
	DefaultConcurrency    = 64
	DefaultRPM            = 600
	DefaultTPM            = 200000
	DefaultLatency        = 200 * time.Millisecond
	DefaultFirstMinute    = time.Minute
	DefaultFairnessWarmup = 30 * time.Second
	DefaultFairnessJobs   = 20
	DefaultRunTimeout     = 15 * time.Minute
	DefaultStall          = 3 * time.Minute
)

// Targets of the admission control, checked by Report.Violations.
const (
	// TargetGoodput is the least steady-state goodput (successful calls per minute
	// after the first minute, divided by the provider's requests per minute) with
	// admission control on.
	TargetGoodput = 0.95
	// TargetLimitedShare is the largest share of model requests answered 429 with
	// admission control on.
	TargetLimitedShare = 0.01
	// TargetFairness is the largest ratio of a late tenant's time to its fair-share
	// time.
	TargetFairness = 2.0
)

// Run names, for Config.Runs.
const (
	RunConfigured = "configured" // admission on, ONCEFLOW_LLM_RPM and _TPM set
	RunOneTenant  = "one-tenant" // as RunConfigured, the backlog from one tenant
	RunLearnt     = "learnt"     // admission on, nothing configured: learnt from headers
	RunOff        = "off"        // admission off: the baseline
	RunFairness   = "fairness"   // admission on (configured): a late tenant's wait
)

// AllRuns are the runs in the order Run performs them.
var AllRuns = []string{RunConfigured, RunOneTenant, RunLearnt, RunOff, RunFairness}

// Config sets up a benchmark. Zero fields take the Default* values.
type Config struct {
	// Bin is the onceflow binary. Required.
	Bin string
	// Dir holds each run's Redis data and process logs (Dir/<run>/*.log). Required.
	Dir string
	// DatabaseURL is a PostgreSQL on which each run creates (and at its end drops) a
	// schema of its own. Required.
	DatabaseURL string
	// Runs are the runs to perform, by name (AllRuns). Default: all of them.
	Runs []string
	// Jobs is the backlog of each run. Default: 2000.
	Jobs int
	// Tenants is the number of tenants of a goodput run's backlog (RunOneTenant's is
	// one). Default: 3.
	Tenants int
	// Workers is the number of `onceflow work` processes. Default: 4.
	Workers int
	// Concurrency is each worker's ONCEFLOW_WORKER_CONCURRENCY. Default: 64.
	Concurrency int
	// RPM and TPM are fake-llm's limits (and the configured run's). Default: 600 and
	// 200000.
	RPM, TPM int
	// Latency is fake-llm's time to answer. Default: 200ms.
	Latency time.Duration
	// FirstMinute is the start of a run left out of the steady state: both of the
	// provider's buckets start with a minute's worth. Default: 1m.
	FirstMinute time.Duration
	// FairnessWarmup is how long the fairness run's backlog runs alone before the late
	// tenant's jobs are queued. Default: 30s.
	FairnessWarmup time.Duration
	// FairnessJobs is the late tenant's jobs. Default: 20.
	FairnessJobs int
	// RunTimeout bounds one run. Default: 15m.
	RunTimeout time.Duration
	// Stall ends a run that made no progress (no job summarised or dead-lettered) for
	// this long. Default: 3m.
	Stall time.Duration
	// Seed drives the jobs' texts. Default: 15.
	Seed uint64
	// Log receives progress. Default: io.Discard.
	Log io.Writer
}

func (c *Config) withDefaults() error {
	if c.Bin == "" || c.Dir == "" || c.DatabaseURL == "" {
		return errors.New("limitbench: Config.Bin, Dir and DatabaseURL are required")
	}
	if len(c.Runs) == 0 {
		c.Runs = AllRuns
	}
	for _, r := range c.Runs {
		if !slices.Contains(AllRuns, r) {
			return fmt.Errorf("limitbench: unknown run %q (known: %s)", r, strings.Join(AllRuns, ", "))
		}
	}
	c.Jobs = cmp.Or(c.Jobs, DefaultJobs)
	c.Tenants = cmp.Or(c.Tenants, DefaultTenants)
	c.Workers = cmp.Or(c.Workers, DefaultWorkers)
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.RPM = cmp.Or(c.RPM, DefaultRPM)
	c.TPM = cmp.Or(c.TPM, DefaultTPM)
	c.Latency = cmp.Or(c.Latency, DefaultLatency)
	c.FirstMinute = cmp.Or(c.FirstMinute, DefaultFirstMinute)
	c.FairnessWarmup = cmp.Or(c.FairnessWarmup, DefaultFairnessWarmup)
	c.FairnessJobs = cmp.Or(c.FairnessJobs, DefaultFairnessJobs)
	c.RunTimeout = cmp.Or(c.RunTimeout, DefaultRunTimeout)
	c.Stall = cmp.Or(c.Stall, DefaultStall)
	c.Seed = cmp.Or(c.Seed, 15)
	if c.Log == nil {
		c.Log = io.Discard
	}
	if c.Jobs < 1 || c.Tenants < 1 || c.Workers < 1 || c.Concurrency < 1 || c.RPM < 1 || c.TPM < 1 || c.FairnessJobs < 1 {
		return errors.New("limitbench: Config's counts and limits must be positive")
	}
	return nil
}

// Run performs cfg's runs one after the other and returns their report. An error means
// a run could not be carried out (a process would not start, a store failed); a target
// missed or an invariant broken is in the report (Report.Violations), not an error.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.withDefaults(); err != nil {
		return nil, err
	}
	b := &bench{cfg: cfg, start: time.Now()}
	rep := &Report{Config: cfg, Texts: textStats(b.texts(cfg.Jobs, 0)), CPUs: runtime.NumCPU(), Started: b.start}
	for _, name := range cfg.Runs {
		if name == RunFairness {
			f, err := b.fairness(ctx)
			if err != nil {
				return rep, fmt.Errorf("fairness run: %w", err)
			}
			rep.Fairness = f
			continue
		}
		g, err := b.goodput(ctx, name)
		if err != nil {
			return rep, fmt.Errorf("%s run: %w", name, err)
		}
		rep.Goodput = append(rep.Goodput, g)
	}
	return rep, nil
}

// bench is one Run's state.
type bench struct {
	cfg   Config
	start time.Time
}

func (b *bench) logf(format string, args ...any) {
	fmt.Fprintf(b.cfg.Log, "[%6.1fs] %s\n", time.Since(b.start).Seconds(), fmt.Sprintf(format, args...))
}

// Phrases of the jobs' texts: a support ticket's sentences.
var phrases = []string{
	"The customer reports that the nightly export to their warehouse fails with a timeout after about forty minutes.",
	"They upgraded the connector last Tuesday and the failures started the same night.",
	"Two invoices were sent twice to the same billing contact, and the second one carried a different total.",
	"The account manager asks whether the discount agreed in the renewal call was applied to the March invoice.",
	"Support already restarted the sync job twice; each restart worked for a day and then the errors came back.",
	"The customer's security team wants to know where the audit logs are stored and for how long they are kept.",
	"A user on the enterprise plan cannot reset their password because the reset email never arrives.",
	"The mobile app shows an empty dashboard for accounts with more than ten thousand records.",
	"Their finance lead would like a single consolidated invoice for the three regional subsidiaries.",
	"The webhook endpoint returned 502 errors for an hour, and some order updates seem to be missing.",
	"They ask for the migration of their historical data to be scheduled outside business hours in Sydney.",
	"The customer threatens to escalate if the duplicate shipment is not credited before the end of the quarter.",
}

// texts returns n job texts of 400 to 800 characters, deterministic for the seed and
// stream (so that every run summarises the same work).
func (b *bench) texts(n int, stream uint64) []string {
	rng := rand.New(rand.NewPCG(b.cfg.Seed, stream)) // #nosec G404 -- reproducible test data, not a secret
	out := make([]string, n)
	for i := range out {
		want := 400 + rng.IntN(401)
		var sb strings.Builder
		fmt.Fprintf(&sb, "Ticket %d:", i)
		for sb.Len() < want {
			p := phrases[rng.IntN(len(phrases))]
			if sb.Len()+1+len(p) > 800 {
				break
			}
			sb.WriteByte(' ')
			sb.WriteString(p)
		}
		out[i] = sb.String()
	}
	return out
}

// TextStats describes the jobs' prompts and what each call costs in tokens.
type TextStats struct {
	// MeanChars is the mean length of a job's text (characters).
	MeanChars float64
	// MeanEstimate is llm.EstimateTokens of a job's request: what the limiter and
	// fake-llm charge at admission (the prompt's estimate plus 1024 output tokens, as
	// the summaries workflow sets no max_tokens).
	MeanEstimate float64
	// MeanUsage is what fake-llm reports as the call's usage, to which both correct
	// the charge once the answer is in: prompt characters / 4 plus the summary's.
	MeanUsage float64
}

// textStats computes TextStats of texts, the way summaries builds its request and
// fake-llm answers it.
func textStats(texts []string) TextStats {
	var st TextStats
	for _, t := range texts {
		prompt := summaries.Prompt(t)
		req := &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: prompt}}}
		st.MeanChars += float64(utf8.RuneCountInString(t))
		st.MeanEstimate += float64(llm.EstimateTokens(req))
		// fake-llm: input (runes+3)/4; output the summary with its random " [sample
		// xxxxxxxx]" tag (it does not honour Idempotency-Key here).
		st.MeanUsage += float64((utf8.RuneCountInString(prompt)+3)/4 + fake.EstimateTokens(fake.Summary(prompt)+" [sample 01234567]"))
	}
	n := float64(max(len(texts), 1))
	st.MeanChars /= n
	st.MeanEstimate /= n
	st.MeanUsage /= n
	return st
}
