package chaos

import (
	"strings"
	"testing"
	"time"
)

func TestDeadReason(t *testing.T) {
	for in, want := range map[string]string{
		"exceeded 3 deliveries; last error: model: 503 server_error": "exceeded 3 deliveries",
		"exceeded 3 deliveries":                         "exceeded 3 deliveries",
		"permanent: model: 400 context_length_exceeded": "permanent",
		"malformed: no job_id field":                    "malformed",
	} {
		if got := deadReason(in); got != want {
			t.Errorf("deadReason(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestBreakerOpenLine(t *testing.T) {
	for line, want := range map[string]string{
		`onceflow_breaker_open{dependency="postgres"} 1`:                      "postgres",
		`onceflow_breaker_open{dependency="llm",provider="openai"} 1`:         "llm",
		`onceflow_breaker_open{dependency="redis"} 0`:                         "",
		`onceflow_breaker_open_since_timestamp_seconds{dependency="redis"} 1`: "",
	} {
		got := ""
		if m := breakerOpen.FindStringSubmatch(line); m != nil {
			got = m[1]
		}
		if got != want {
			t.Errorf("%s: open dependency %q, want %q", line, got, want)
		}
	}
}

// TestOutageReportString renders a failing report as the Markdown table the docs take.
func TestOutageReportString(t *testing.T) {
	rep := &OutageReport{Seed: 7, Duration: time.Minute, Settings: "ClaimIdle 2s",
		Phases: []PhaseReport{
			{Name: "baseline", What: "baseline", Drained: -1, Seen: Observation{FirstNamed: -1, FirstOpen: -1}},
			{Name: "llm", What: "model answers 503", Outage: 20 * time.Second, Accepted: 10, Poison: 1,
				DeadByReason: map[string]int{"exceeded 3 deliveries": 4, "permanent": 1}, Drained: -1,
				Seen: Observation{Polls: 5, Named: 2, FirstNamed: 1500 * time.Millisecond, Sample: "llm: degraded: `503`", MetricPolls: 5, FirstOpen: -1}},
		},
		Violations: []string{"something"}, Events: []string{"0.00s outage begins"}}
	s := rep.String()
	for _, want := range []string{
		"| model answers 503 | 20s | 10 (1) | exceeded 3 deliveries: 4, permanent: 1 | 0 / 0 | not drained | 2 of 5 polls, first after 1.5s (`llm: degraded: '503'`) | 0 of 5 polls |",
		"| baseline | - | 0 (0) | none |",
		"- VIOLATION: something",
		"0.00s outage begins",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("report lacks %q:\n%s", want, s)
		}
	}
}
