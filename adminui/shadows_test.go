package adminui_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/llm"
)

// shadowRun is a row of shadow_runs as a shadow job records it.
type shadowRun struct {
	key, candidate, tenant, job, step string
	prod, cand                        llm.Response
	agree                             bool
	score                             float64
	detail                            string
	prodMS, candMS                    int64
	prodTokens, candTokens            int // input; output is a quarter of it
	prodUSD, candUSD                  float64
	age                               time.Duration
}

// insertShadowRuns writes runs to e's shadow_runs table.
func insertShadowRuns(t *testing.T, e *adminuitest.Env, runs ...shadowRun) {
	t.Helper()
	for _, r := range runs {
		prod, _ := json.Marshal(r.prod)
		cand, _ := json.Marshal(r.cand)
		if _, err := e.Client.Inspector().DB().Exec(context.Background(), `INSERT INTO shadow_runs (prod_key, candidate, tenant, job_id, kind, step,
	prod_model, cand_model, prod_answer, cand_answer, agree, score, detail, prod_latency_ms, cand_latency_ms,
	prod_input_tokens, prod_output_tokens, cand_input_tokens, cand_output_tokens, prod_cost_usd, cand_cost_usd, created_at)
VALUES ($1, $2, $3, $4, 'summarise', $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, now() - make_interval(secs => $21))`,
			r.key, r.candidate, r.tenant, r.job, r.step, r.prod.Model, r.cand.Model, prod, cand, r.agree, r.score, r.detail,
			r.prodMS, r.candMS, r.prodTokens, r.prodTokens/4, r.candTokens, r.candTokens/4, r.prodUSD, r.candUSD, r.age.Seconds()); err != nil {
			t.Fatal(err)
		}
	}
}

// summaryRuns are four runs of step summary's candidate gpt-4.1-nano in the last hour
// (three agree; production 800 ms and 0.01 USD a call, the candidate 400 ms and 0.0025),
// one of two days ago that disagreed, and two of step classify's candidate small that
// both disagreed, one with a tool call.
func summaryRuns() []shadowRun {
	prod := llm.Response{Model: "gpt-4.1", Content: "The invoice is overdue by 12 days."}
	var runs []shadowRun
	for i, agree := range []bool{true, true, true, false} {
		r := shadowRun{key: "sum-" + string(rune('a'+i)), candidate: "gpt-4.1-nano", tenant: "acme", job: "00000000-0000-4000-8000-00000000010" + string(rune('1'+i)),
			step: "summary", prod: prod, cand: prod, agree: agree, score: 1, prodMS: 800, candMS: 400, prodTokens: 400, candTokens: 400,
			prodUSD: 0.01, candUSD: 0.0025, age: time.Duration(i+1) * time.Minute}
		r.cand.Model = "gpt-4.1-nano"
		if !agree {
			r.cand.Content, r.score, r.detail = "The invoice was paid.", 0.25, "the text differs"
		}
		runs = append(runs, r)
	}
	old := runs[3]
	old.key, old.job, old.score, old.age = "sum-old", "00000000-0000-4000-8000-000000000199", 0.5, 48*time.Hour
	old.cand.Content = "An answer from two days ago."
	runs = append(runs, old)
	cls := llm.Response{Model: "gpt-4.1", ToolCalls: []llm.ToolCall{{ID: "c1", Name: "route_ticket", Arguments: `{"queue":"billing"}`}}}
	for i, score := range []float64{0.5, 0} {
		r := shadowRun{key: "cls-" + string(rune('a'+i)), candidate: "small", job: "00000000-0000-4000-8000-00000000020" + string(rune('1'+i)),
			step: "classify", prod: cls, cand: llm.Response{Model: "tiny-1", Content: "billing"}, score: score, detail: "0 tool calls, production 1",
			prodMS: 300, candMS: 450, prodTokens: 100, candTokens: 80, age: time.Minute}
		runs = append(runs, r)
	}
	runs[len(runs)-1].cand = llm.Response{Model: "tiny-1", ToolCalls: []llm.ToolCall{{ID: "x", Name: "route_ticket", Arguments: `{"queue":"sales"}`}}}
	return runs
}

// The page shows, per step and candidate, the runs, the agreement, the mean score, both
// latencies, costs and tokens with the deltas; then the worst disagreements (lowest
// score first) with both answers side by side and their jobs linked; ?step=, ?since=
// and ?worst= select what it covers.
func TestShadowsPageShowsAgreementPerStepAndCandidate(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	insertShadowRuns(t, e, summaryRuns()...)
	c, _ := signedIn(t, e)

	resp, page := adminuitest.Get(t, c, e.URL+"/ui/shadows")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("shadows: %d %.2000s", resp.StatusCode, page)
	}
	for _, want := range []string{
		`<a href="/ui/shadows" aria-current="page">Shadows</a>`,
		`name="since" value="24h"`, `name="worst" type="number" min="0" max="100" value="10"`,
		// summary / gpt-4.1-nano: 4 runs of the last day, 3 agreed; mean score
		// (1+1+1+0.25)/4; 800 -> 400 ms; 0.04 -> 0.01 USD; 4*(400+100) tokens each.
		`<td><code>summary</code></td><td>gpt-4.1-nano</td><td class="num">4</td><td class="num agreement">3 (75.0 %)</td><td class="num">0.81</td>`,
		`<td class="num">800 ms</td><td class="num">400 ms</td><td class="num better">-400 ms (-50.0 %)</td>`,
		`<td class="num">0.0400</td><td class="num">0.0100</td><td class="num better">-0.0300 USD (-75.0 %)</td>`,
		`<td class="num">2000</td><td class="num">2000</td>`,
		// classify / small: 2 runs, none agreed, slower, no cost known.
		`<td><code>classify</code></td><td>small</td><td class="num">2</td><td class="num agreement">0 (0.0 %)</td><td class="num">0.25</td>`,
		`<td class="num worse">&#43;150 ms (&#43;50.0 %)</td>`, `<td class="num ">0.0000 USD</td>`,
		"The worst disagreements <small>(3)</small>",
		`<a href="/ui/jobs/00000000-0000-4000-8000-000000000202"><code>00000000-0000-4000-8000-000000000202</code></a>`,
		`<a href="/ui/jobs/00000000-0000-4000-8000-000000000104"><code>00000000-0000-4000-8000-000000000104</code></a>, tenant acme`,
		"The invoice is overdue by 12 days.", "The invoice was paid.", "the text differs",
		`calls <code>route_ticket</code> with</p><pre class="args">{
  &#34;queue&#34;: &#34;billing&#34;
}</pre>`,
		`&#34;queue&#34;: &#34;sales&#34;`, "<small>(tiny-1)</small>",
	} {
		if !strings.Contains(page, want) {
			t.Fatalf("shadows page lacks %q: %.9000s", want, page)
		}
	}
	// Lowest score first: classify's 0, then summary's 0.25 and classify's 0.5; the run
	// of two days ago is outside the default window.
	i0, i1, i2 := strings.Index(page, "000000000202"), strings.Index(page, "000000000104"), strings.Index(page, "000000000201")
	if i0 < 0 || i1 < i0 || i2 < i1 || strings.Contains(page, "two days ago") {
		t.Errorf("disagreements out of order or out of the window: %d %d %d", i0, i1, i2)
	}

	_, page = adminuitest.Get(t, c, e.URL+"/ui/shadows?step=classify")
	if !strings.Contains(page, "<td><code>classify</code></td>") || strings.Contains(page, "<code>summary</code>") || strings.Contains(page, "The invoice") ||
		!strings.Contains(page, `value="classify"`) {
		t.Errorf("step filter: %.6000s", page)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/shadows?step=summary&since=72h")
	if !strings.Contains(page, `<td class="num">5</td><td class="num agreement">3 (60.0 %)</td>`) || !strings.Contains(page, "An answer from two days ago.") ||
		strings.Contains(page, "classify") || !strings.Contains(page, `value="72h"`) {
		t.Errorf("since=72h: %.6000s", page)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/shadows?worst=1")
	if n := strings.Count(page, `<article class="disagreement">`); n != 1 || !strings.Contains(page, "000000000202") {
		t.Errorf("worst=1 shows %d disagreements", n)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/shadows?worst=0")
	if n := strings.Count(page, `<article class="disagreement">`); n != 0 || !strings.Contains(page, "3 (75.0 %)") {
		t.Errorf("worst=0 shows %d disagreements", n)
	}
}

// A window, a count or a step the page cannot report is a 400 that says what it wants.
func TestShadowsPageRefusesBadParameters(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	c, _ := signedIn(t, e)
	for q, want := range map[string]string{
		"since=abc":                        "since &#34;abc&#34; is not a window the page reports: give a Go duration from 1m to 8784h",
		"since=7d":                         "like 30m, 24h or 168h for a week",
		"since=-1h":                        "since &#34;-1h&#34; is not a window",
		"since=30s":                        "from 1m to 8784h",
		"since=9000h":                      "from 1m to 8784h",
		"worst=-1":                         "worst must be a whole number from 0 to 100.",
		"worst=101":                        "worst must be a whole number from 0 to 100.",
		"worst=ten":                        "worst must be a whole number from 0 to 100.",
		"step=a%0Ab":                       "A step&#39;s name is 1 to 200 printable ASCII characters.",
		"step=" + strings.Repeat("s", 201): "A step&#39;s name is 1 to 200",
	} {
		resp, page := adminuitest.Get(t, c, e.URL+"/ui/shadows?"+q)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(page, want) {
			t.Errorf("%s: %d, want 400 with %q: %.1500s", q, resp.StatusCode, want, page)
		}
	}
}

// Answers are untrusted model output: markup in them, in the candidate's name, the
// tenant or the detail is shown as text; a long answer is cut with a visible marker; a
// job id that is not one has no link.
func TestShadowsPageEscapesAndClipsAnswers(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	xss := `<script>alert(1)</script>`
	long := strings.Repeat("é", 4000) + "TAIL-NOT-SHOWN" + strings.Repeat("x", 986)
	insertShadowRuns(t, e,
		shadowRun{key: "k1", candidate: xss, tenant: "t<b>", job: "not a job id " + xss, step: "summary", score: 0, detail: xss,
			prod: llm.Response{Content: "fine " + xss}, cand: llm.Response{ToolCalls: []llm.ToolCall{{Name: xss, Arguments: `{"html":"<img src=x onerror=alert(1)>"}`}}}},
		shadowRun{key: "k2", candidate: "long", job: "00000000-0000-4000-8000-000000000301", step: "summary", score: 0.1,
			prod: llm.Response{Content: long}, cand: llm.Response{Content: "short"}},
	)
	c, _ := signedIn(t, e)
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/shadows")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("shadows: %d", resp.StatusCode)
	}
	for _, bad := range []string{"<script>alert", "<img src=x", "t<b>", "TAIL-NOT-SHOWN", `href="/ui/jobs/not`} {
		if strings.Contains(page, bad) {
			t.Errorf("the page shows %q", bad)
		}
	}
	for _, want := range []string{"fine &lt;script&gt;alert(1)&lt;/script&gt;", "calls <code>&lt;script&gt;alert(1)&lt;/script&gt;</code>",
		"&lt;img src=x onerror=alert(1)&gt;", "t&lt;b&gt;", `<code>not a job id &lt;script&gt;`,
		strings.Repeat("é", 4000) + `<span class="clipped">… (1000 more characters)</span>`} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q: %.3000s", want, page)
		}
	}
}

// The page is behind the admin sign-in like every other: without a session, or with a
// made-up one, it leads to the sign-in form and shows nothing.
func TestShadowsPageNeedsASession(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	insertShadowRuns(t, e, summaryRuns()...)
	forged := adminuitest.Browser(t)
	u, _ := url.Parse(e.URL + "/ui/")
	forged.Jar.SetCookies(u, []*http.Cookie{{Name: "onceflow_ui", Value: "made-up-session-token", Path: "/ui/"}})
	for name, c := range map[string]*http.Client{"no session": adminuitest.Browser(t), "made-up session": forged} {
		resp, page := adminuitest.Get(t, c, e.URL+"/ui/shadows?step=summary")
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/login" || strings.Contains(page, "gpt-4.1-nano") {
			t.Errorf("%s: %d to %q: %.300s", name, resp.StatusCode, resp.Header.Get("Location"), page)
		}
	}
}

// Without shadow runs the page says so and how to turn shadows on.
func TestShadowsPageSaysWhenThereAreNoRuns(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	c, _ := signedIn(t, e)
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/shadows")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "No shadow runs since") || !strings.Contains(page, "<code>ONCEFLOW_SHADOW</code>") ||
		strings.Contains(page, "worst disagreements") {
		t.Errorf("empty shadows page: %d %.3000s", resp.StatusCode, page)
	}
	_, page = adminuitest.Get(t, c, e.URL+"/ui/shadows?step=summary")
	if !strings.Contains(page, "No shadow runs of step <code>summary</code> since") {
		t.Errorf("empty shadows page of a step: %.3000s", page)
	}
}
