// Package gatewaybench measures what `onceflow gateway` (gateway) costs in front of
// a model server, with real processes on loopback: `onceflow fake-llm` as
// the upstream, `onceflow gateway` processes in front of it, and a database of the
// benchmark's own on the PostgreSQL named by Config.DatabaseURL, created, migrated and
// dropped by Run.
//
// Overhead: for each mode (ModeUnary, ModeStream, ModeKeyless) the same request is
// sent to fake-llm directly and through the gateway, in the same run:
//
//   - latency, at concurrency 1: Config.LatencyPairs pairs of requests, one direct and
//     one through the gateway, the order swapped every pair, after Config.Warmup pairs
//     left out; the percentiles of both sides, their differences, and the percentiles
//     of the per-pair differences (gateway minus direct); for ModeUnary, also the
//     gateway's two ledger statements alone (ledger.Begin, Attempt.Succeed), made from
//     the benchmark's process after each pair: what PostgreSQL accounts for;
//   - throughput, at Config.Concurrency: Config.Rounds rounds, each a closed-loop run
//     of Config.RunDuration directly and one through the gateway (internal/testenv/loadgen),
//     the order swapped every round; requests per second, the ratio of the medians and
//     the median of the per-round ratios, and the CPU time the gateway and fake-llm
//     spent per request (from /proc).
//
// Keyed requests carry a fresh Idempotency-Key each, so every one is forwarded and
// recorded (llm_calls): the gateway's real work. Keyless requests pass through.
//
// Join: a second fake-llm drips its answers (one byte every Config.DripInterval), so a
// stream lasts a few seconds. Each of Config.JoinTrials trials sends a streaming
// request with a fresh key to one gateway process, and Config.JoinDelay after its
// first byte sends the same request to the same process and to a second gateway
// process at once. For each joiner: the time to its first body byte, the time until it
// has the bytes the first request had when the joiner was sent (catch-up), and, for
// every byte after those, how much later than the first request it got it (live lag).
// Every joiner's bytes must equal the first request's.
//
// Run returns a Report; its String is the Markdown the benchmark prints. Nothing is
// written into the repository: `make bench-gateway` (TestGatewayBench, gated by
// ONCEFLOW_GATEWAY_BENCH=1) prints the report, and docs/BENCHMARKS.md records runs'
// figures by hand.
package gatewaybench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// Modes of the overhead measurement, for Config.Modes.
const (
	ModeUnary   = "unary"   // POST /v1/chat/completions with a fresh Idempotency-Key: forwarded and recorded
	ModeStream  = "stream"  // the same with "stream": true
	ModeKeyless = "keyless" // the unary request without a key: passed through
)

// AllModes are the modes in the order Run measures them.
var AllModes = []string{ModeUnary, ModeStream, ModeKeyless}

// Defaults of Config's fields.
const (
	DefaultLatencyPairs = 1000
	DefaultWarmup       = 50
	DefaultConcurrency  = 16
	DefaultRounds       = 5
	DefaultRunDuration  = 3 * time.Second
	DefaultJoinTrials   = 30
	DefaultModelLatency = 200 * time.Millisecond
	DefaultModelConc    = 64
	DefaultJoinDelay    = time.Second
	DefaultDripInterval = 500 * time.Microsecond
)

// Targets of the gateway's overhead, checked by Report.Targets.
const (
	// TargetThroughputRatio is the least gateway / direct throughput of keyed requests.
	TargetThroughputRatio = 0.8
	// TargetAddedP50 is the largest latency the gateway adds at the median, on loopback.
	TargetAddedP50 = 2 * time.Millisecond
)

// Config sets up a benchmark. Zero fields take the Default* values.
type Config struct {
	// Bin is the onceflow binary. Required.
	Bin string
	// Dir holds the processes' logs. Required.
	Dir string
	// DatabaseURL is a PostgreSQL role allowed to create databases: Run creates one of
	// its own (and drops it at the end). Required.
	DatabaseURL string
	// Modes are the overhead modes to measure, by name (AllModes). Default (nil): all;
	// empty but not nil: none.
	Modes []string
	// LatencyPairs is the number of (direct, gateway) pairs of requests of a mode's
	// latency measurement. Default: 1000.
	LatencyPairs int
	// Warmup is the number of pairs sent and left out before a latency measurement.
	// (Before its throughput rounds each side runs max(1s, RunDuration/3) unmeasured.)
	// Default: 50.
	Warmup int
	// Concurrency is the number of requests in flight in a throughput run. Default: 16.
	Concurrency int
	// Rounds is the number of (direct, gateway) throughput runs per mode. Default: 5.
	Rounds int
	// RunDuration is the length of one throughput run. Default: 3s.
	RunDuration time.Duration
	// UpstreamLatency is the overhead measurement's fake-llm --latency. Default: 0, so
	// that what is measured is the gateway, not a wait both sides share.
	UpstreamLatency time.Duration
	// ModelLatency is the fake-llm --latency of the second throughput measurement,
	// against an upstream that takes as long as a model does, where what counts is
	// whether the gateway holds back the calls in flight, not its CPU time against an
	// upstream that costs nothing. Negative: no such measurement. Default: 200ms.
	ModelLatency time.Duration
	// ModelConcurrency is the number of requests in flight in that measurement.
	// Default: 64.
	ModelConcurrency int
	// ProxyBin is a reference proxy's binary (./lab/gatewaybench/bareproxy,
	// net/http/httputil's ReverseProxy and nothing else), measured like the gateway
	// in front of the upstream that answers at once: what any proxy hop costs on the
	// machine. Empty: no reference.
	ProxyBin string
	// JoinTrials is the number of join trials. Negative: no join measurement.
	// Default: 30.
	JoinTrials int
	// JoinDelay is how long after the first request's first byte the joiners are sent.
	// Default: 1s.
	JoinDelay time.Duration
	// DripInterval is the join measurement's fake-llm --drip-interval: with the
	// default, a stream of about 5 KB lasts about 3 s. Default: 500µs.
	DripInterval time.Duration
	// GatewayEnv is added to every gateway process's environment (after the
	// benchmark's own ONCEFLOW_* settings, so it may override them): to measure a
	// setting such as ONCEFLOW_LEDGER_RELAXED_INSERT=true. Default: none.
	GatewayEnv []string
	// Log receives progress. Default: io.Discard.
	Log io.Writer
}

func (c *Config) withDefaults() error {
	if c.Bin == "" || c.Dir == "" || c.DatabaseURL == "" {
		return errors.New("gatewaybench: Config.Bin, Dir and DatabaseURL are required")
	}
	if c.Modes == nil {
		c.Modes = AllModes
	}
	for _, m := range c.Modes {
		if !slices.Contains(AllModes, m) {
			return fmt.Errorf("gatewaybench: unknown mode %q (known: %s)", m, strings.Join(AllModes, ", "))
		}
	}
	c.LatencyPairs = cmp.Or(c.LatencyPairs, DefaultLatencyPairs)
	c.Warmup = cmp.Or(c.Warmup, DefaultWarmup)
	c.Concurrency = cmp.Or(c.Concurrency, DefaultConcurrency)
	c.ModelLatency = cmp.Or(c.ModelLatency, DefaultModelLatency)
	c.ModelConcurrency = cmp.Or(c.ModelConcurrency, DefaultModelConc)
	c.Rounds = cmp.Or(c.Rounds, DefaultRounds)
	c.RunDuration = cmp.Or(c.RunDuration, DefaultRunDuration)
	c.JoinTrials = cmp.Or(c.JoinTrials, DefaultJoinTrials)
	c.JoinDelay = cmp.Or(c.JoinDelay, DefaultJoinDelay)
	c.DripInterval = cmp.Or(c.DripInterval, DefaultDripInterval)
	if c.Log == nil {
		c.Log = io.Discard
	}
	if c.LatencyPairs < 1 || c.Warmup < 0 || c.Concurrency < 1 || c.Rounds < 1 || c.RunDuration <= 0 || c.UpstreamLatency < 0 ||
		c.JoinDelay < 0 || c.DripInterval < 0 {
		return errors.New("gatewaybench: Config's counts and durations must be positive")
	}
	return nil
}

// Run performs the measurements cfg asks for and returns their report. An error means
// the benchmark could not be carried out (a process would not start, the database
// failed); failed requests and targets missed are in the report.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.withDefaults(); err != nil {
		return nil, err
	}
	b := &bench{cfg: cfg, start: time.Now()}
	rep := &Report{Config: cfg, Started: b.start}
	defer func() { rep.Elapsed = time.Since(b.start) }()
	s, err := b.newStack(ctx)
	if err != nil {
		return nil, err
	}
	defer s.close()
	rep.Upstream = s.fast.Args
	for _, mode := range cfg.Modes {
		lat, err := b.latency(ctx, s, mode)
		if err != nil {
			return rep, fmt.Errorf("%s latency: %w", mode, err)
		}
		rep.Latency = append(rep.Latency, lat)
		for _, tg := range s.targets() {
			tp, err := b.throughput(ctx, s, mode, tg)
			if err != nil {
				return rep, fmt.Errorf("%s throughput (%s): %w", mode, tg.setting, err)
			}
			rep.Throughput = append(rep.Throughput, tp)
		}
	}
	if cfg.JoinTrials > 0 {
		j, err := b.join(ctx, s)
		if err != nil {
			return rep, fmt.Errorf("join: %w", err)
		}
		rep.Join = j
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
