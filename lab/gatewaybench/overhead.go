package gatewaybench

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/common/expfmt"
	promodel "github.com/prometheus/common/model"

	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/internal/testenv/loadgen"
	"github.com/onceflow/onceflow/ledger"
)

// prompt is the user message of every request: a support ticket of about 600
// characters, the size of the summaries workflow's.
const prompt = "Summarise this support ticket for the account team in three sentences. " +
	"The customer reports that the nightly export to their warehouse fails with a timeout after about forty minutes. " +
	"They upgraded the connector last Tuesday and the failures started the same night. " +
	"Support already restarted the sync job twice; each restart worked for a day and then the errors came back. " +
	"The webhook endpoint returned 502 errors for an hour, and some order updates seem to be missing. " +
	"The customer threatens to escalate if the duplicate shipment is not credited before the end of the quarter."

// model is the model the requests name.
const model = "gpt-4.1-mini"

// bodies of the requests, by streaming or not.
var (
	unaryBody  = mustJSON(map[string]any{"model": model, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	streamBody = mustJSON(map[string]any{"model": model, "messages": []map[string]string{{"role": "user", "content": prompt}}, "stream": true})
)

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// streamEnd ends every complete OpenAI stream.
var streamEnd = []byte("data: [DONE]\n\n")

// keys hands out fresh Idempotency-Keys: a random prefix per process and a counter.
var keys = struct {
	prefix string
	n      atomic.Int64
}{prefix: func() string {
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	return "gatewaybench-" + hex.EncodeToString(rnd[:]) + "-"
}()}

func freshKey() string { return keys.prefix + strconv.FormatInt(keys.n.Add(1), 10) }

// request returns a POST /v1/chat/completions to base (fake-llm's or a gateway's) of
// mode; key is its Idempotency-Key (none when empty).
func request(ctx context.Context, base string, stream bool, key string) (*http.Request, error) {
	body := unaryBody
	if stream {
		body = streamBody
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk-gatewaybench")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	return req, nil
}

// modeRequest returns a request of mode to base, with a fresh key when the mode is keyed.
func modeRequest(ctx context.Context, base, mode string) (*http.Request, error) {
	key := ""
	if mode != ModeKeyless {
		key = freshKey()
	}
	return request(ctx, base, mode == ModeStream, key)
}

// check judges the answer to a request of mode; viaGateway says where it was sent.
func check(mode string, viaGateway bool, resp *http.Response, body []byte) error {
	switch {
	case resp.StatusCode != http.StatusOK:
		return fmt.Errorf("status %d: %.200s", resp.StatusCode, body)
	case viaGateway && mode != ModeKeyless && resp.Header.Get("Idempotent-Replayed") != "":
		return errors.New("a fresh key was answered from a replay")
	case mode == ModeStream && !bytes.HasSuffix(body, streamEnd):
		return fmt.Errorf("stream of %d bytes does not end with [DONE]", len(body))
	case mode != ModeStream && !json.Valid(body):
		return fmt.Errorf("answer of %d bytes is not JSON", len(body))
	}
	return nil
}

// exchange is one timed request.
type exchange struct {
	resp  *http.Response // body read and closed
	body  []byte
	ttfb  time.Duration // to the first body byte
	total time.Duration // to the end of the body
	err   error
}

// send sends req and reads its answer, timing the first body byte and the end.
func (s *stack) send(req *http.Request) exchange {
	t0 := time.Now()
	resp, err := s.client.Do(req)
	if err != nil {
		return exchange{err: err, total: time.Since(t0)}
	}
	defer resp.Body.Close()
	ex := exchange{resp: resp}
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if ex.body == nil {
				ex.ttfb = time.Since(t0)
			}
			ex.body = append(ex.body, buf[:n]...)
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			ex.err = err
			break
		}
	}
	ex.total = time.Since(t0)
	return ex
}

// Dist summarises a distribution of durations.
type Dist struct {
	N             int
	P50, P99, Max time.Duration
}

// distOf returns the Dist of ds (which it sorts).
func distOf(ds []time.Duration) Dist {
	sortDurations(ds)
	return Dist{N: len(ds), P50: quantile(ds, 0.5), P99: quantile(ds, 0.99), Max: quantile(ds, 1)}
}

// LatencyResult is one mode's latency measurement, at concurrency 1.
type LatencyResult struct {
	Mode  string
	Pairs int
	// Direct and Gateway are the requests' times to the end of their answer; Diff the
	// per-pair differences, gateway minus direct.
	Direct, Gateway, Diff Dist
	// DirectTTFB, GatewayTTFB and DiffTTFB are the same to the first body byte.
	DirectTTFB, GatewayTTFB, DiffTTFB Dist
	// Ledger, for ModeUnary, is the time of the gateway's two ledger statements alone,
	// made from the benchmark's process after each pair (ledger.Begin inserting the row,
	// Attempt.Succeed recording the answer; two round trips, two durable commits): the
	// part of the added latency PostgreSQL accounts for.
	Ledger       Dist
	Failures     int
	FirstFailure string
	// Load is the 1-minute load average before and after.
	Load [2]float64
}

// AddedP50 and AddedP99 are the gateway's percentile minus the direct one.
func (r *LatencyResult) AddedP50() time.Duration { return r.Gateway.P50 - r.Direct.P50 }

// AddedP99 is the gateway's 99th percentile minus the direct one.
func (r *LatencyResult) AddedP99() time.Duration { return r.Gateway.P99 - r.Direct.P99 }

// latency measures mode's latency at concurrency 1: pairs of requests, one direct and
// one through the gateway, the order swapped every pair.
func (b *bench) latency(ctx context.Context, s *stack, mode string) (*LatencyResult, error) {
	c := b.cfg
	r := &LatencyResult{Mode: mode, Pairs: c.LatencyPairs, Load: [2]float64{cluster.LoadAvg()}}
	var direct, gw, diff, directFB, gwFB, diffFB, led []time.Duration
	one := func(base string, viaGateway bool) (exchange, error) {
		req, err := modeRequest(ctx, base, mode)
		if err != nil {
			return exchange{}, err
		}
		ex := s.send(req)
		if ex.err == nil {
			ex.err = check(mode, viaGateway, ex.resp, ex.body)
		}
		return ex, nil
	}
	for i := -c.Warmup; i < c.LatencyPairs; i++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var d, g exchange
		var err error
		if i%2 == 0 {
			if d, err = one(s.fastURL, false); err == nil {
				g, err = one(s.gwURL, true)
			}
		} else {
			if g, err = one(s.gwURL, true); err == nil {
				d, err = one(s.fastURL, false)
			}
		}
		if err != nil {
			return nil, err
		}
		if i < 0 {
			continue
		}
		if d.err != nil || g.err != nil {
			r.Failures++
			if r.FirstFailure == "" {
				r.FirstFailure = fmt.Sprintf("direct: %v; gateway: %v", d.err, g.err)
			}
			continue
		}
		if mode == ModeUnary {
			t, err := s.ledgerCall(ctx, d)
			if err != nil {
				return nil, fmt.Errorf("ledger alone: %w", err)
			}
			led = append(led, t)
		}
		direct, gw, diff = append(direct, d.total), append(gw, g.total), append(diff, g.total-d.total)
		directFB, gwFB, diffFB = append(directFB, d.ttfb), append(gwFB, g.ttfb), append(diffFB, g.ttfb-d.ttfb)
	}
	r.Direct, r.Gateway, r.Diff = distOf(direct), distOf(gw), distOf(diff)
	r.DirectTTFB, r.GatewayTTFB, r.DiffTTFB = distOf(directFB), distOf(gwFB), distOf(diffFB)
	r.Ledger = distOf(led)
	r.Load[1] = cluster.LoadAvg()
	b.logf("%s latency: %d pairs: direct p50 %v p99 %v, gateway p50 %v p99 %v, added p50 %v (per pair %v), %d failed",
		mode, c.LatencyPairs, r.Direct.P50, r.Direct.P99, r.Gateway.P50, r.Gateway.P99, r.AddedP50(), r.Diff.P50, r.Failures)
	return r, nil
}

// ledgerCall records a call the way the gateway does, from this process: ledger.Begin
// (the in_flight row) then Attempt.Succeed with the answer of ex (a direct answer), and
// returns the time both took.
func (s *stack) ledgerCall(ctx context.Context, ex exchange) (time.Duration, error) {
	m, err := json.Marshal(map[string]any{"status": ex.resp.StatusCode, "header": ex.resp.Header})
	if err != nil {
		return 0, err
	}
	sum := sha256.Sum256(unaryBody)
	call := ledger.Call{Key: "gatewaybench-ledger-" + freshKey(), Work: "POST /v1/chat/completions", RequestHash: hex.EncodeToString(sum[:]),
		Provider: "gatewaybench", Model: model}
	t0 := time.Now()
	att, rec, err := s.ledger.Begin(ctx, call)
	if err != nil {
		return 0, err
	}
	if rec != nil {
		return 0, errors.New("a fresh key was already recorded")
	}
	if _, _, err := att.Succeed(ctx, ledger.Result{Response: ex.body, Raw: ex.body, Meta: m}); err != nil {
		return 0, err
	}
	return time.Since(t0), nil
}

// RunResult is one closed-loop throughput run.
type RunResult struct {
	Requests, Failures int64
	FirstFailure       string
	RPS                float64
	P50, P99           time.Duration
	// GatewayCPU, UpstreamCPU, PostgresCPU and ClientCPU are the CPU time spent during
	// the run by the gateway process, fake-llm, the PostgreSQL backends of the
	// benchmark's database and the benchmark's own process, the load generator (10ms
	// resolution).
	GatewayCPU, UpstreamCPU, PostgresCPU, ClientCPU time.Duration
	// Commits are the ledger transactions the gateway committed during the run (its
	// onceflow_llm_ledger_group_writes_count: a group of writes, or a write alone, is
	// one commit); 0 through a process that records nothing.
	Commits uint64
}

// Round is a (direct, gateway) pair of throughput runs.
type Round struct {
	Direct, Gateway RunResult
	GatewayFirst    bool
}

// Ratio is the round's gateway / direct requests per second.
func (r Round) Ratio() float64 { return r.Gateway.RPS / r.Direct.RPS }

// Settings of a throughput measurement (ThroughputResult.Setting).
const (
	// SettingAtOnce: the gateway in front of fake-llm answering at once, at
	// Config.Concurrency. On a machine whose cores the processes share, the ratio is
	// then about the ratio of CPU time per request.
	SettingAtOnce = "at-once"
	// SettingBareProxy: the reference proxy (Config.ProxyBin) in front of the same
	// fake-llm, at Config.Concurrency: what a proxy hop costs at all.
	SettingBareProxy = "bare-proxy"
	// SettingModel: the gateway in front of fake-llm taking Config.ModelLatency per
	// answer, at Config.ModelConcurrency.
	SettingModel = "model"
)

// ThroughputResult is one mode's throughput measurement in one setting.
type ThroughputResult struct {
	Mode        string
	Setting     string // Setting*
	Latency     time.Duration
	Concurrency int
	Rounds      []Round
	Load        [2]float64
}

// Medians returns the median direct and gateway requests per second.
func (t *ThroughputResult) Medians() (direct, gateway float64) {
	var d, g []float64
	for _, r := range t.Rounds {
		d, g = append(d, r.Direct.RPS), append(g, r.Gateway.RPS)
	}
	return median(d), median(g)
}

// Ratios returns the per-round ratios, sorted.
func (t *ThroughputResult) Ratios() []float64 {
	var out []float64
	for _, r := range t.Rounds {
		out = append(out, r.Ratio())
	}
	sortFloats(out)
	return out
}

// Failures returns the failed requests of every run.
func (t *ThroughputResult) Failures() (n int64, first string) {
	for _, r := range t.Rounds {
		for _, x := range []RunResult{r.Direct, r.Gateway} {
			n += x.Failures
			if first == "" {
				first = x.FirstFailure
			}
		}
	}
	return n, first
}

// CommitsPerRequest returns the gateway's ledger commits per request of its runs, the
// median over the rounds.
func (t *ThroughputResult) CommitsPerRequest() float64 {
	var v []float64
	for _, r := range t.Rounds {
		if r.Gateway.Requests > 0 {
			v = append(v, float64(r.Gateway.Commits)/float64(r.Gateway.Requests))
		}
	}
	return median(v)
}

// CPU is the CPU time per request of each process, medians over the rounds.
type CPU struct {
	Client, Gateway, Postgres, Upstream time.Duration
}

// Total is the CPU time per request of all the processes.
func (c CPU) Total() time.Duration { return c.Client + c.Gateway + c.Postgres + c.Upstream }

// CPUPerRequest returns the CPU time per request of the direct and of the gateway runs,
// each process's the median over the rounds.
func (t *ThroughputResult) CPUPerRequest() (direct, gateway CPU) {
	per := func(pick func(RunResult) time.Duration, gw bool) time.Duration {
		var v []float64
		for _, r := range t.Rounds {
			x := r.Direct
			if gw {
				x = r.Gateway
			}
			v = append(v, perRequest(pick(x), x.Requests))
		}
		return time.Duration(median(v))
	}
	for _, gw := range []bool{false, true} {
		c := CPU{
			Client:   per(func(r RunResult) time.Duration { return r.ClientCPU }, gw),
			Gateway:  per(func(r RunResult) time.Duration { return r.GatewayCPU }, gw),
			Postgres: per(func(r RunResult) time.Duration { return r.PostgresCPU }, gw),
			Upstream: per(func(r RunResult) time.Duration { return r.UpstreamCPU }, gw),
		}
		if gw {
			gateway = c
		} else {
			direct = c
		}
	}
	return direct, gateway
}

func perRequest(d time.Duration, n int64) float64 {
	if n == 0 {
		return 0
	}
	return float64(d) / float64(n)
}

// throughput measures mode's throughput in the setting tg: after a warm-up of each
// side, Config.Rounds pairs of runs, the order swapped every round.
func (b *bench) throughput(ctx context.Context, s *stack, mode string, tg target) (*ThroughputResult, error) {
	c := b.cfg
	t := &ThroughputResult{Mode: mode, Setting: tg.setting, Concurrency: tg.concurrency, Load: [2]float64{cluster.LoadAvg()}}
	if tg.setting == SettingModel {
		t.Latency = c.ModelLatency
	}
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	self := os.Getpid()
	run := func(base string, viaGateway bool, d time.Duration) (RunResult, error) {
		pg0, err := s.backendCPU(ctx, conn)
		if err != nil {
			return RunResult{}, err
		}
		c0, err := ledgerCommits(ctx, s.client, base, viaGateway)
		if err != nil {
			return RunResult{}, err
		}
		gw0, up0, me0 := cluster.CPUTime(tg.proxy.Pid()), cluster.CPUTime(tg.upstream.Pid()), cluster.CPUTime(self)
		res, err := loadgen.Run(ctx, loadgen.Config{
			Concurrency: tg.concurrency, Duration: d, Client: s.client,
			NewRequest: func(int, int) (*http.Request, error) { return modeRequest(ctx, base, mode) },
			Check:      func(resp *http.Response, body []byte) error { return check(mode, viaGateway, resp, body) },
		})
		if err != nil {
			return RunResult{}, err
		}
		if err := ctx.Err(); err != nil {
			return RunResult{}, err
		}
		gw1, up1, me1 := cluster.CPUTime(tg.proxy.Pid()), cluster.CPUTime(tg.upstream.Pid()), cluster.CPUTime(self)
		pg1, err := s.backendCPU(ctx, conn)
		if err != nil {
			return RunResult{}, err
		}
		c1, err := ledgerCommits(ctx, s.client, base, viaGateway)
		if err != nil {
			return RunResult{}, err
		}
		return RunResult{Commits: c1 - c0, Requests: res.Requests, Failures: res.Failures, FirstFailure: res.FirstFailure, RPS: res.RPS(),
			P50: res.Latency.Quantile(0.5), P99: res.Latency.Quantile(0.99),
			GatewayCPU: gw1 - gw0, UpstreamCPU: up1 - up0, PostgresCPU: cpuSince(pg0, pg1), ClientCPU: me1 - me0}, nil
	}
	warm := max(time.Second, c.RunDuration/3)
	for _, side := range []struct {
		base string
		gw   bool
	}{{tg.direct, false}, {tg.via, tg.keyed}} {
		if _, err := run(side.base, side.gw, warm); err != nil {
			return nil, err
		}
	}
	for i := range c.Rounds {
		var r Round
		r.GatewayFirst = i%2 == 1
		var err error
		if r.GatewayFirst {
			if r.Gateway, err = run(tg.via, tg.keyed, c.RunDuration); err == nil {
				r.Direct, err = run(tg.direct, false, c.RunDuration)
			}
		} else {
			if r.Direct, err = run(tg.direct, false, c.RunDuration); err == nil {
				r.Gateway, err = run(tg.via, tg.keyed, c.RunDuration)
			}
		}
		if err != nil {
			return nil, err
		}
		t.Rounds = append(t.Rounds, r)
		b.logf("%s throughput (%s) round %d: direct %.0f req/s, via %.0f req/s (%.2f), failed %d/%d", mode, tg.setting, i+1,
			r.Direct.RPS, r.Gateway.RPS, r.Ratio(), r.Direct.Failures, r.Gateway.Failures)
	}
	t.Load[1] = cluster.LoadAvg()
	return t, nil
}

// ledgerCommits returns the ledger transactions the gateway at base committed so far
// (the sample count of onceflow_llm_ledger_group_writes on its /metrics), or 0 when
// keyed is false (a process that records nothing).
func ledgerCommits(ctx context.Context, c *http.Client, base string, keyed bool) (uint64, error) {
	if !keyed {
		return 0, nil
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, fmt.Errorf("gateway metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("gateway metrics: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(promodel.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return 0, fmt.Errorf("gateway metrics: %w", err)
	}
	const name = "onceflow_llm_ledger_group_writes"
	f := families[name]
	if f == nil || len(f.GetMetric()) != 1 || f.GetMetric()[0].GetHistogram() == nil {
		return 0, fmt.Errorf("gateway metrics: no histogram %s", name)
	}
	return f.GetMetric()[0].GetHistogram().GetSampleCount(), nil
}
