package limitbench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Metrics are Prometheus samples by series ("name{labels}", as the exposition prints
// it), summed over the processes they were scraped from.
type Metrics map[string]float64

// add parses a text exposition from r and adds its samples to m.
func (m Metrics) add(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			return fmt.Errorf("bad sample %q", line)
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return fmt.Errorf("bad sample %q: %w", line, err)
		}
		m[line[:i]] += v
	}
	return sc.Err()
}

// scrape adds the samples of GET url (a /metrics page) to m.
func (m Metrics) scrape(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("scrape %s: %s", url, resp.Status)
	}
	return m.add(resp.Body)
}

// seriesName returns the metric name of series.
func seriesName(series string) string {
	if i := strings.IndexByte(series, '{'); i >= 0 {
		return series[:i]
	}
	return series
}

var labelRE = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// label returns the value of label name in series ("" when it has none).
func label(series, name string) string {
	i := strings.IndexByte(series, '{')
	if i < 0 {
		return ""
	}
	for _, m := range labelRE.FindAllStringSubmatch(series[i:], -1) {
		if m[1] == name {
			return m[2]
		}
	}
	return ""
}

// Sum returns the sum of every series of metric name.
func (m Metrics) Sum(name string) float64 {
	var s float64
	for k, v := range m {
		if seriesName(k) == name {
			s += v
		}
	}
	return s
}

// By returns the sums of metric name's series by the value of label.
func (m Metrics) By(name, lbl string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range m {
		if seriesName(k) == name {
			out[label(k, lbl)] += v
		}
	}
	return out
}

// Deferred renders onceflow_llm_admission_deferred_total by reason ("none" when the
// limiter put nothing off).
func (m Metrics) Deferred() string {
	by := m.By("onceflow_llm_admission_deferred_total", "reason")
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(by)) {
		if by[k] > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, by[k]))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// FailedRuns returns the runs that failed on the job and so spent an attempt: those
// whose next attempt was scheduled, and those dead-lettered.
func (m Metrics) FailedRuns() float64 {
	return m.Sum("onceflow_queue_retries_scheduled_total") + m.Sum("onceflow_queue_dead_lettered_total")
}
