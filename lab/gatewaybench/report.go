package gatewaybench

import (
	"fmt"
	"runtime"
	"strings"
	"time"
)

// Report is what Run measured. String renders it as Markdown.
type Report struct {
	Config     Config
	Started    time.Time
	Elapsed    time.Duration
	Upstream   []string // fake-llm's command line in the overhead measurement
	Latency    []*LatencyResult
	Throughput []*ThroughputResult
	Join       *JoinResult
}

var modeNames = map[string]string{
	ModeUnary:   "unary, keyed (forwarded and recorded)",
	ModeStream:  "stream, keyed (forwarded and recorded)",
	ModeKeyless: "unary, no key (passed through)",
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond)) }

// Violations lists the broken invariants: failed requests, joiners that did not get
// the first request's bytes or were not answered as joined. Targets missed are not
// violations (Targets says).
func (r *Report) Violations() []string {
	var v []string
	for _, l := range r.Latency {
		if l.Failures > 0 {
			v = append(v, fmt.Sprintf("%s latency: %d failed pairs (first: %s)", l.Mode, l.Failures, l.FirstFailure))
		}
	}
	for _, t := range r.Throughput {
		if t.Setting == SettingBareProxy {
			continue // the reference's failures are in its row, not the gateway's
		}
		if n, first := t.Failures(); n > 0 {
			v = append(v, fmt.Sprintf("%s throughput (%s): %d failed requests (first: %s)", t.Mode, t.Setting, n, first))
		}
	}
	if j := r.Join; j != nil {
		if j.Failures > 0 {
			v = append(v, fmt.Sprintf("join: %d trials failed (first: %s)", j.Failures, j.FirstFailure))
		}
		ok := j.Trials - j.Failures
		for _, x := range []JoinerResult{j.Same, j.Other} {
			if x.Failures > 0 {
				v = append(v, fmt.Sprintf("join, %s: %d joiners failed, %d with other bytes (first: %s)", x.Where, x.Failures, x.Mismatches, x.FirstFailure))
			}
			if x.Joined != ok-x.Failures {
				v = append(v, fmt.Sprintf("join, %s: %d of %d answers marked Onceflow-Joined", x.Where, x.Joined, ok-x.Failures))
			}
		}
	}
	return v
}

// Targets lists the gateway's targets with the measured figures, each "met" or "missed".
func (r *Report) Targets() []string {
	var out []string
	for _, t := range r.Throughput {
		if t.Mode == ModeKeyless || t.Setting == SettingBareProxy {
			continue
		}
		d, g := t.Medians()
		ratio := g / d
		line := fmt.Sprintf("%s: throughput %.2f of direct, %s (target ≥ %.1f): %s", t.Mode, ratio, settingNames(t), TargetThroughputRatio,
			verdict(ratio >= TargetThroughputRatio, fmt.Sprintf("%.0f%% short", 100*(TargetThroughputRatio-ratio)/TargetThroughputRatio)))
		if ref := r.throughputOf(t.Mode, SettingBareProxy); ref != nil && t.Setting == SettingAtOnce {
			rd, rg := ref.Medians()
			line += fmt.Sprintf("; the bare reverse proxy in the same setting: %.2f", rg/rd)
		}
		out = append(out, line)
	}
	for _, l := range r.Latency {
		if l.Mode == ModeKeyless {
			continue
		}
		a := l.AddedP50()
		out = append(out, fmt.Sprintf("%s: added latency p50 %s (target < %s): %s", l.Mode, ms(a), ms(TargetAddedP50),
			verdict(a < TargetAddedP50, fmt.Sprintf("%.1fx the target", float64(a)/float64(TargetAddedP50)))))
	}
	return out
}

// throughputOf returns the throughput measurement of mode in setting, if any.
func (r *Report) throughputOf(mode, setting string) *ThroughputResult {
	for _, t := range r.Throughput {
		if t.Mode == mode && t.Setting == setting {
			return t
		}
	}
	return nil
}

// settingNames describes t's setting in words.
func settingNames(t *ThroughputResult) string {
	switch t.Setting {
	case SettingModel:
		return fmt.Sprintf("upstream taking %v (a model), %d in flight", t.Latency, t.Concurrency)
	case SettingBareProxy:
		return fmt.Sprintf("reference: a bare reverse proxy (httputil) in front of the upstream answering at once, %d in flight", t.Concurrency)
	}
	return fmt.Sprintf("upstream answering at once, %d in flight", t.Concurrency)
}

func verdict(ok bool, by string) string {
	if ok {
		return "met"
	}
	return "missed, " + by
}

// String renders the report as Markdown.
func (r *Report) String() string {
	var b strings.Builder
	c := r.Config
	fmt.Fprintf(&b, "Gateway benchmark started %s, %d CPUs, took %v. Upstream: `onceflow %s`.",
		r.Started.UTC().Format("2006-01-02 15:04 MST"), runtime.NumCPU(), r.Elapsed.Round(time.Second), strings.Join(r.Upstream, " "))
	if len(c.GatewayEnv) > 0 {
		fmt.Fprintf(&b, " Gateway environment added: `%s`.", strings.Join(c.GatewayEnv, " "))
	}
	b.WriteString("\n\n")
	if len(r.Latency) > 0 {
		fmt.Fprintf(&b, "Latency at concurrency 1: %d pairs per mode (direct and through the gateway, the order swapped every pair, after %d pairs of warm-up); added = gateway − direct.\n\n",
			c.LatencyPairs, c.Warmup)
		b.WriteString("| mode | to | direct p50 | gateway p50 | added p50 | direct p99 | gateway p99 | added p99 | per-pair difference p50 / p99 | failed | load |\n")
		b.WriteString("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
		for _, l := range r.Latency {
			rows := []latencyRow{{"end of answer", l.Direct, l.Gateway, l.Diff}}
			if l.Mode == ModeStream {
				rows = []latencyRow{{"first byte", l.DirectTTFB, l.GatewayTTFB, l.DiffTTFB}, rows[0]}
			}
			for _, x := range rows {
				fmt.Fprintf(&b, "| %s | %s | %s | %s | **%s** | %s | %s | %s | %s / %s | %d | %.1f → %.1f |\n", modeNames[l.Mode], x.to,
					ms(x.d.P50), ms(x.g.P50), ms(x.g.P50-x.d.P50), ms(x.d.P99), ms(x.g.P99), ms(x.g.P99-x.d.P99),
					ms(x.dif.P50), ms(x.dif.P99), l.Failures, l.Load[0], l.Load[1])
			}
		}
		for _, l := range r.Latency {
			if l.Ledger.N > 0 {
				fmt.Fprintf(&b, "\nThe ledger alone, in the same %s pairs (ledger.Begin then Attempt.Succeed from the benchmark's process, after each pair: the gateway's two statements and durable commits without HTTP): p50 %s, p99 %s.\n",
					l.Mode, ms(l.Ledger.P50), ms(l.Ledger.P99))
			}
		}
		b.WriteString("\n")
	}
	if len(r.Throughput) > 0 {
		fmt.Fprintf(&b, "Throughput: %d rounds per mode and setting, each %v direct and %v through the proxy (the gateway, or the reference proxy; the order swapped every round); medians over the rounds.\n\n",
			c.Rounds, c.RunDuration, c.RunDuration)
		b.WriteString("| mode | setting | direct req/s | via req/s | ratio of medians | median of round ratios | round ratios | CPU per request, direct: client + fake-llm | via: client + proxy + PostgreSQL + fake-llm | ledger commits per request | via p50 / p99 | failed | load |\n")
		b.WriteString("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |\n")
		for _, t := range r.Throughput {
			d, g := t.Medians()
			ratios := t.Ratios()
			dc, gc := t.CPUPerRequest()
			var p50, p99 []float64
			for _, rd := range t.Rounds {
				p50, p99 = append(p50, float64(rd.Gateway.P50)), append(p99, float64(rd.Gateway.P99))
			}
			n, _ := t.Failures()
			fmt.Fprintf(&b, "| %s | %s | %.0f | %.0f | **%.2f** | %.2f | %.2f–%.2f | %.0f + %.0f = %.0f µs | %.0f + %.0f + %.0f + %.0f = %.0f µs | %s | %s / %s | %d | %.1f → %.1f |\n",
				modeNames[t.Mode], settingNames(t), d, g, g/d, median(ratios), ratios[0], ratios[len(ratios)-1],
				us(dc.Client), us(dc.Upstream), us(dc.Total()), us(gc.Client), us(gc.Gateway), us(gc.Postgres), us(gc.Upstream), us(gc.Total()),
				commitsText(t), ms(time.Duration(median(p50))), ms(time.Duration(median(p99))), n, t.Load[0], t.Load[1])
		}
		b.WriteString("\n")
	}
	if j := r.Join; j != nil {
		fmt.Fprintf(&b, "Join: %d trials; fake-llm drips its stream (%d bytes, median) one byte every %v: the first request's stream lasted %s (p50), %s (p99); "+
			"the joiners were sent %v after its first byte, when it had %d bytes (median).\n\n",
			j.Trials, j.StreamBytes, j.DripInterval, ms(j.Stream.P50), ms(j.Stream.P99), j.JoinDelay, j.BytesAtJoin)
		b.WriteString("| joiner | answers | joined | first byte p50 | first byte p99 | caught up p50 | caught up p99 | live lag per byte p50 | p99 | max | bytes differ | failed | load |\n")
		b.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
		for _, x := range []JoinerResult{j.Same, j.Other} {
			fmt.Fprintf(&b, "| %s | %d | %d | **%s** | %s | **%s** | %s | %s | %s | %s | %d | %d | %.1f → %.1f |\n", x.Where, x.TTFB.N, x.Joined,
				ms(x.TTFB.P50), ms(x.TTFB.P99), ms(x.CatchUp.P50), ms(x.CatchUp.P99), ms(x.Lag.P50), ms(x.Lag.P99), ms(x.Lag.Max),
				x.Mismatches, x.Failures, j.Load[0], j.Load[1])
		}
		b.WriteString("\n")
	}
	if t := r.Targets(); len(t) > 0 {
		b.WriteString("Targets:\n\n- " + strings.Join(t, "\n- ") + "\n")
	}
	if v := r.Violations(); len(v) > 0 {
		b.WriteString("\nInvariants broken:\n\n- " + strings.Join(v, "\n- ") + "\n")
	}
	return b.String()
}

// commitsText is t's ledger commits per request through the gateway, or "–" when none
// were counted: through the reference proxy, or a gateway whose group commit is off
// (ONCEFLOW_LEDGER_GROUP_LINGER=off: every write a transaction of its own, two per
// keyed request, which the metric does not count).
func commitsText(t *ThroughputResult) string {
	if c := t.CommitsPerRequest(); c > 0 {
		return fmt.Sprintf("%.2f", c)
	}
	return "–"
}

// latencyRow is a row of the latency table: the direct, gateway and per-pair
// difference distributions of a time to something.
type latencyRow struct {
	to        string
	d, g, dif Dist
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
