package adminui

import (
	"cmp"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/queue"
)

// Bounds of the shadows page.
const (
	// defaultShadowSince and maxShadowSince are the default and the longest window the
	// page reports (?since=, a Go duration); minShadowSince the shortest.
	defaultShadowSince = "24h"
	minShadowSince     = time.Minute
	maxShadowSince     = 366 * 24 * time.Hour
	// defaultShadowWorst and maxShadowWorst are the default and the most disagreements
	// the page shows (?worst=).
	defaultShadowWorst = 10
	maxShadowWorst     = 100
	// maxShownAnswer bounds what the page shows of an answer's text, maxShownCallArgs of
	// each tool call's arguments and maxShownCalls the tool calls of an answer;
	// maxShownDetail bounds a comparison's detail. All in characters but the calls.
	maxShownAnswer   = 4000
	maxShownCallArgs = 1000
	maxShownCalls    = 10
	maxShownDetail   = 500
)

// shadowsData is the shadows page's.
type shadowsData struct {
	Step  string // the filter; "" for every step
	Since string // the window, as typed (a Go duration)
	Worst int
	// From is where the window begins.
	From          time.Time
	Summaries     []shadowSummaryRow
	Disagreements []disagreementView
	NoDB          bool
}

// shadowSummaryRow is one step and candidate's summary with its deltas.
type shadowSummaryRow struct {
	onceflow.ShadowSummary
	AgreementPercent float64
	// LatencyDelta and CostDelta are the candidate's mean latency and total cost less
	// production's, signed, with the change in percent when production's is not 0.
	LatencyDelta, CostDelta string
	// LatencyClass and CostClass colour the deltas: "worse" when the candidate's is the
	// higher, "better" when it is the lower, "" when they are equal.
	LatencyClass, CostClass string
}

// disagreementView is one of the worst disagreements, both answers clipped.
type disagreementView struct {
	Step, Candidate, Tenant, JobID string
	JobPath                        string // the job's page, "" when JobID is not a job id
	Score                          float64
	Detail                         string // where the answers differ, clipped
	At                             time.Time
	Production, Shadow             answerView
}

// answerView is a model's answer as the page shows it.
type answerView struct {
	Content   string
	Clipped   int // characters left out of Content
	Calls     []callView
	CallsLeft int // tool calls not shown
	Model     string
	Empty     bool // neither text nor tool calls
}

// shadows serves GET /ui/shadows: the shadow report (Inspector.ShadowReport) of the runs
// of the last ?since= (a Go duration, default 24h), of every step or of ?step=: per step
// and candidate the runs, the agreement with production, the mean score, both mean
// latencies, costs and tokens with the deltas; and the ?worst= (default 10) worst
// disagreements, production's answer and the candidate's side by side.
func (u *UI) shadows(w http.ResponseWriter, r *http.Request, s *session) {
	t0 := time.Now()
	d := shadowsData{Step: strings.TrimSpace(r.FormValue("step")), Since: strings.TrimSpace(r.FormValue("since")), Worst: defaultShadowWorst}
	bad := func(title, msg string) {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: title, CSRF: s.csrf, Error: msg})
	}
	if d.Step != "" && !printableASCII(d.Step, onceflow.MaxStepNameLen) {
		bad("Bad step", fmt.Sprintf("A step's name is 1 to %d printable ASCII characters.", onceflow.MaxStepNameLen))
		return
	}
	d.Since = cmp.Or(d.Since, defaultShadowSince)
	since, err := time.ParseDuration(d.Since)
	if err != nil || since < minShadowSince || since > maxShadowSince {
		shown, _ := clipRunes(d.Since, 40)
		bad("Bad window", fmt.Sprintf("since %q is not a window the page reports: give a Go duration from 1m to 8784h (366 days), like 30m, 24h or 168h for a week.", shown))
		return
	}
	if v := strings.TrimSpace(r.FormValue("worst")); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > maxShadowWorst {
			bad("Bad count", fmt.Sprintf("worst must be a whole number from 0 to %d.", maxShadowWorst))
			return
		}
		d.Worst = n
	}
	d.From = u.now().Add(-since)
	if u.db == nil {
		d.NoDB = true
		u.render(w, r, http.StatusOK, "shadows", page{Title: "Shadows", Nav: "shadows", CSRF: s.csrf, Data: d})
		return
	}
	q := onceflow.ShadowQuery{Step: d.Step, Since: d.From, Worst: d.Worst}
	if d.Worst == 0 {
		q.Worst = -1 // none (0 is the report's default)
	}
	rep, err := u.client.Inspector().ShadowReport(r.Context(), q)
	if err != nil {
		u.unavailable(w, r, err)
		return
	}
	for _, sm := range rep.Summaries {
		row := shadowSummaryRow{ShadowSummary: sm, AgreementPercent: 100 * sm.Agreement,
			LatencyClass: deltaClass(sm.CandLatencyMS, sm.ProdLatencyMS), CostClass: deltaClass(sm.CandCostUSD, sm.ProdCostUSD)}
		row.LatencyDelta = delta(sm.CandLatencyMS-sm.ProdLatencyMS, sm.ProdLatencyMS, "%+.0f ms")
		row.CostDelta = delta(sm.CandCostUSD-sm.ProdCostUSD, sm.ProdCostUSD, "%+.4f USD")
		d.Summaries = append(d.Summaries, row)
	}
	for _, dis := range rep.Disagreements {
		v := disagreementView{Step: dis.Step, Candidate: dis.Candidate, Tenant: dis.Tenant, JobID: dis.JobID, Score: dis.Score, At: dis.At,
			Production: showAnswer(dis.Production), Shadow: showAnswer(dis.Shadow)}
		if queue.ValidJobID(dis.JobID) {
			v.JobPath = u.base + "jobs/" + url.PathEscape(dis.JobID)
		}
		if det, cut := clipRunes(dis.Detail, maxShownDetail); cut > 0 {
			v.Detail = det + "…"
		} else {
			v.Detail = det
		}
		d.Disagreements = append(d.Disagreements, v)
	}
	u.render(w, r, http.StatusOK, "shadows", page{Title: "Shadows", Nav: "shadows", CSRF: s.csrf, Data: d, Elapsed: time.Since(t0)})
}

// delta renders diff with format (signed, but for 0), and its share of base in percent
// when base is not 0.
func delta(diff, base float64, format string) string {
	out := fmt.Sprintf(format, diff)
	if diff == 0 {
		return strings.TrimPrefix(out, "+")
	}
	if base != 0 && !math.IsNaN(diff) {
		out += fmt.Sprintf(" (%+.1f %%)", 100*diff/base)
	}
	return out
}

// deltaClass is "worse" when the candidate's figure is above production's, "better"
// when below, "" when they are equal.
func deltaClass(cand, prod float64) string {
	switch {
	case cand > prod:
		return "worse"
	case cand < prod:
		return "better"
	}
	return ""
}

// showAnswer clips an answer for the page: its text, and its first tool calls with
// their arguments (indented when they are JSON).
func showAnswer(r *llm.Response) answerView {
	if r == nil {
		return answerView{Empty: true}
	}
	v := answerView{Model: r.Model}
	v.Content, v.Clipped = clipRunes(r.Content, maxShownAnswer)
	for i, c := range r.ToolCalls {
		if i == maxShownCalls {
			v.CallsLeft = len(r.ToolCalls) - i
			break
		}
		v.Calls = append(v.Calls, callView{Name: c.Name, Args: showJSON(c.Arguments, maxShownCallArgs)})
	}
	v.Empty = r.Content == "" && len(r.ToolCalls) == 0
	return v
}

// printableASCII reports whether s is 1 to n printable ASCII characters.
func printableASCII(s string, n int) bool {
	return s != "" && len(s) <= n && !strings.ContainsFunc(s, func(r rune) bool { return r < ' ' || r > '~' })
}
