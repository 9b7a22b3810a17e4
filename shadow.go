package onceflow

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
)

// ShadowQueue is the queue shadow runs go through (Config.Shadows): off the production
// jobs' path, worked by every process that works its queues (its settings are
// Config.Queues[ShadowQueue]'s, when given).
const ShadowQueue = "shadow"

// ShadowKind is the kind of the jobs that run shadows.
const ShadowKind = "onceflow.shadow"

// Shadow runs a candidate beside a production model step: a sampled share of the
// step's production calls is also made to the candidate (another model, or the same
// with its request transformed: another prompt), and the two answers are compared and
// recorded in the shadow_runs table. A shadow never causes an effect: it runs as a job
// of its own on ShadowQueue after the production call answered, the candidate's tool
// calls are compared, never run, and nothing of it reaches the production job (its
// answer, its commit, its tools). See docs/shadows.md.
type Shadow struct {
	// Step is the production step's name as the job gives it to Job.Complete or
	// Job.Stream (RunAgent's turns are "<AgentConfig.Name>.turn-<n>"). Required.
	Step string
	// Kind, when set, limits the shadow to the steps of jobs of that kind.
	Kind string
	// Model is the candidate's model: the production request's Model replaced. Empty
	// keeps production's (with Transform, a prompt change on the same model).
	Model string
	// Name names the candidate in shadow_runs and reports (1 to 64 printable ASCII
	// characters). Default: Model.
	Name string
	// Transform, when set, changes the candidate's request (a copy of production's,
	// Model already replaced): another system prompt, other sampling settings.
	Transform func(req *llm.Request)
	// Rate is the share of the step's production calls shadowed, 0 to 1. Which calls is
	// decided by a hash of the job, the step and the candidate, so every delivery of a
	// job decides alike.
	Rate float64
	// Compare compares production's answer with the candidate's. Default: ExactMatch.
	Compare func(production, candidate *llm.Response) Comparison
	// Judge, when set instead of Compare, has a model grade the candidate's agreement
	// with production: the judge's call is a background model step of the shadow job
	// ("judge"), recorded in the ledger, and the shadow agrees when its score reaches
	// Judge.Threshold.
	Judge *Judge
}

// candidateRequest is the candidate's request: a copy of production's req with s's
// Model and Transform applied (req itself is not changed).
func (s *Shadow) candidateRequest(req *llm.Request) llm.Request {
	out := *req
	out.Messages = slices.Clone(out.Messages)
	out.Tools = slices.Clone(out.Tools)
	if s.Model != "" {
		out.Model = s.Model
	}
	if s.Transform != nil {
		s.Transform(&out)
	}
	return out
}

// name is the candidate's name: Name, else Model, else "transform".
func (s Shadow) name() string { return cmp.Or(s.Name, s.Model, "transform") }

// Comparison is how a candidate's answer compares with production's.
type Comparison struct {
	// Agree says whether the candidate's answer agrees with production's.
	Agree bool `json:"agree"`
	// Score grades the agreement from 0 to 1 (1 for agreement by a comparator that does
	// not grade).
	Score float64 `json:"score"`
	// Detail says where they differ ("" when they agree), for the report.
	Detail string `json:"detail,omitempty"`
}

// ExactMatch compares two answers exactly: the same text (leading and trailing space
// aside) and the same tool calls (names and arguments, as JSON with sorted keys, in
// order; the providers' call ids aside).
func ExactMatch(production, candidate *llm.Response) Comparison {
	if p, c := strings.TrimSpace(production.Content), strings.TrimSpace(candidate.Content); p != c {
		return Comparison{Detail: "the text differs"}
	}
	if len(production.ToolCalls) != len(candidate.ToolCalls) {
		return Comparison{Detail: fmt.Sprintf("%d tool calls, production %d", len(candidate.ToolCalls), len(production.ToolCalls))}
	}
	for i, p := range production.ToolCalls {
		if toolkey.ContentKey(p) != toolkey.ContentKey(candidate.ToolCalls[i]) {
			return Comparison{Detail: fmt.Sprintf("tool call %d differs: %s, production %s", i+1, candidate.ToolCalls[i].Name, p.Name)}
		}
	}
	return Comparison{Agree: true, Score: 1}
}

// JSONFieldsMatch returns a comparator for structured answers: both texts are decoded
// as JSON objects and the named top-level fields compared (as JSON values: 1 and 1.0
// agree, key order does not matter). The score is the share of the fields that agree;
// the answers agree when all do. A text that is not a JSON object agrees with nothing.
func JSONFieldsMatch(fields ...string) func(production, candidate *llm.Response) Comparison {
	return func(production, candidate *llm.Response) Comparison {
		var p, c map[string]any
		if err := json.Unmarshal([]byte(production.Content), &p); err != nil || p == nil {
			return Comparison{Detail: "production's answer is not a JSON object"}
		}
		if err := json.Unmarshal([]byte(candidate.Content), &c); err != nil || c == nil {
			return Comparison{Detail: "the candidate's answer is not a JSON object"}
		}
		var differ []string
		for _, f := range fields {
			pv, _ := json.Marshal(p[f])
			cv, _ := json.Marshal(c[f])
			if !bytes.Equal(pv, cv) {
				differ = append(differ, f)
			}
		}
		out := Comparison{Agree: len(differ) == 0, Score: 1}
		if len(fields) > 0 {
			out.Score = float64(len(fields)-len(differ)) / float64(len(fields))
		}
		if len(differ) > 0 {
			out.Detail = "fields differ: " + strings.Join(differ, ", ")
		}
		return out
	}
}

// ParseShadows reads ONCEFLOW_SHADOW: comma-separated STEP=MODEL@RATE (for example
// "summary=gpt-4.1-nano@0.25"), RATE from 0 to 1 after the last "@". Each entry is a Shadow with Step,
// Model and Rate; "" gives none.
func ParseShadows(s string) ([]Shadow, error) {
	var out []Shadow
	for _, entry := range strings.Split(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		step, rest, ok := strings.Cut(entry, "=")
		at := strings.LastIndexByte(rest, '@') // a model's name may hold "@" (Vertex AI's do)
		if !ok || at < 0 {
			return nil, fmt.Errorf("shadow %q: want STEP=MODEL@RATE", entry)
		}
		model, rate := rest[:at], rest[at+1:]
		r, err := strconv.ParseFloat(strings.TrimSpace(rate), 64)
		if err != nil {
			return nil, fmt.Errorf("shadow %q: rate %q: want a number from 0 to 1", entry, rate)
		}
		sh := Shadow{Step: strings.TrimSpace(step), Model: strings.TrimSpace(model), Rate: r}
		if err := sh.check(); err != nil {
			return nil, err
		}
		out = append(out, sh)
	}
	return out, nil
}

// check validates a Shadow's fields.
func (s Shadow) check() error {
	switch {
	case checkStepName(s.Step) != nil:
		return fmt.Errorf("shadow of step %q: the step is not 1 to %d printable ASCII characters", clipText(s.Step), MaxStepNameLen)
	case s.Model == "" && s.Transform == nil:
		return fmt.Errorf("shadow of step %q: neither a Model nor a Transform: the candidate would be production", s.Step)
	case math.IsNaN(s.Rate) || s.Rate < 0 || s.Rate > 1:
		return fmt.Errorf("shadow of step %q: rate %v: want 0 to 1", s.Step, s.Rate)
	case !printableName(s.name(), 64):
		return fmt.Errorf("shadow of step %q: candidate name %q: want 1 to 64 printable ASCII characters", s.Step, clipText(s.name()))
	case s.Kind != "" && s.Kind == ShadowKind:
		return fmt.Errorf("shadow of step %q: shadows are not shadowed", s.Step)
	}
	if s.Judge != nil {
		if s.Compare != nil {
			return fmt.Errorf("shadow %q of step %q: set Compare or Judge, not both", s.name(), s.Step)
		}
		if err := s.Judge.check(false); err != nil {
			return fmt.Errorf("shadow %q of step %q: %w", s.name(), s.Step, err)
		}
	}
	return nil
}

// printableName reports whether s is 1 to n printable ASCII characters.
func printableName(s string, n int) bool {
	if len(s) == 0 || len(s) > n {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// sampled reports whether the production call of job id's step is shadowed at rate:
// a hash of the job, the step and the candidate, so every delivery decides alike.
func sampled(id, step, candidate string, rate float64) bool {
	if rate >= 1 {
		return true
	}
	if rate <= 0 {
		return false
	}
	h := sha256.Sum256([]byte(id + "\x00" + step + "\x00" + candidate))
	return float64(binary.BigEndian.Uint64(h[:8])>>11)/float64(1<<53) < rate
}

// shadowArgs are a shadow job's arguments: the production call and its answer.
type shadowArgs struct {
	Tenant    string        `json:"tenant,omitempty"`
	JobID     string        `json:"job_id"`
	JobKind   string        `json:"kind"`
	Step      string        `json:"step"`
	Candidate string        `json:"candidate"`
	Key       string        `json:"key"` // the production call's ledger key
	Request   *llm.Request  `json:"request"`
	Response  *llm.Response `json:"response"`
	LatencyMS int64         `json:"latency_ms"` // the production call's, as its delivery measured it
}

func (shadowArgs) Kind() string             { return ShadowKind }
func (shadowArgs) EnqueueOpts() EnqueueOpts { return EnqueueOpts{Queue: ShadowQueue} }

// DefaultShadowRetention is how long a shadow run is kept (Config.ShadowRetention).
const DefaultShadowRetention = 30 * 24 * time.Hour

// shadows is the Client's shadow runs, by step.
type shadows struct {
	byStep    map[string][]Shadow
	db        *pgxpool.Pool
	retention time.Duration
	log       *slog.Logger
}

// purge deletes the shadow runs older than the retention, a batch per statement, and
// returns how many.
func (s *shadows) purge(ctx context.Context) (int64, error) {
	return purgeInBatches(ctx, s.db, "old shadow runs", `DELETE FROM shadow_runs WHERE ctid IN (
	SELECT ctid FROM shadow_runs WHERE created_at < now() - $2::bigint * interval '1 microsecond' LIMIT $1)`, s.retention.Microseconds())
}

// run purges old shadow runs every stepPurgeInterval until ctx ends.
func (s *shadows) run(ctx context.Context) error {
	return purgeEvery(ctx, s.log, "old shadow runs", s.purge)
}

// setupShadows checks Config.Shadows and registers the shadow worker (a workflow of
// onceflow's own: ShadowQueue, ShadowKind). cp is filled with the Client once built.
func setupShadows(cfg *Config, cp **Client) (*shadows, error) {
	if len(cfg.Shadows) == 0 {
		return nil, nil
	}
	if cfg.ShadowRetention < 0 {
		return nil, fmt.Errorf("onceflow: Config.ShadowRetention %v must not be negative", cfg.ShadowRetention)
	}
	s := &shadows{byStep: map[string][]Shadow{}, db: cfg.DB, retention: cmp.Or(cfg.ShadowRetention, DefaultShadowRetention), log: cfg.Logger}
	seen := map[string]bool{}
	for _, sh := range cfg.Shadows {
		if err := sh.check(); err != nil {
			return nil, fmt.Errorf("onceflow: Config.Shadows: %w", err)
		}
		if seen[sh.Step+"\x00"+sh.name()] {
			return nil, fmt.Errorf("onceflow: Config.Shadows: step %q has candidate %q twice", sh.Step, sh.name())
		}
		seen[sh.Step+"\x00"+sh.name()] = true
		s.byStep[sh.Step] = append(s.byStep[sh.Step], sh)
	}
	if cfg.Model == nil {
		return nil, errors.New("onceflow: Config.Shadows need Config.Model (the candidates are model calls)")
	}
	if cfg.DB == nil {
		return nil, errors.New("onceflow: Config.Shadows need Config.DB (the shadow_runs table is in PostgreSQL)")
	}
	cfg.Workflows = append(slices.Clip(cfg.Workflows), Workflow{Name: "onceflow.shadow",
		Workers: func(ws *Workers) error {
			return AddWorkerSafely(ws, WorkFunc[shadowArgs](func(ctx context.Context, job *Job[shadowArgs]) error {
				return (*cp).runShadow(ctx, job)
			}))
		}})
	return s, nil
}

// shadow enqueues the shadow runs of a production call that answered: one job per
// candidate whose sample takes it, keyed by the call and the candidate, so a
// redelivered job that replays the call enqueues nothing new. A shadow that cannot be
// enqueued is logged and dropped: production does not wait for it.
func (rt *runtime) shadow(ctx context.Context, jobID, step string, req *llm.Request, s *Step, took time.Duration) {
	c := rt.client
	if c.shadows == nil || rt.delivery == nil || rt.delivery.Kind == ShadowKind {
		return
	}
	for _, sh := range c.shadows.byStep[step] {
		if sh.Kind != "" && sh.Kind != rt.delivery.Kind || !sampled(jobID, step, sh.name(), sh.Rate) {
			continue
		}
		args := shadowArgs{Tenant: rt.delivery.Tenant, JobID: jobID, JobKind: rt.delivery.Kind, Step: step, Candidate: sh.name(),
			Key: s.Key, Request: req, Response: s.Response, LatencyMS: took.Milliseconds()}
		key := "shadow:" + sh.name() + ":" + s.Key
		_, err := c.Enqueue(context.WithoutCancel(ctx), args, &EnqueueOpts{Key: key})
		if errors.Is(err, idempotency.ErrKeyReused) {
			continue // an earlier delivery made the call and enqueued its shadow (its latency differed)
		}
		if err != nil {
			c.log.WarnContext(ctx, "onceflow: shadow run not enqueued; production goes on without it",
				"job_id", jobID, "step", step, "candidate", sh.name(), "err", err)
		}
	}
}

// shadowRunSQL records a shadow run once per production call and candidate.
const shadowRunSQL = `INSERT INTO shadow_runs (tenant, job_id, kind, step, candidate, prod_key, prod_model, cand_model,
    prod_answer, cand_answer, agree, score, detail, prod_latency_ms, cand_latency_ms,
    prod_input_tokens, prod_output_tokens, cand_input_tokens, cand_output_tokens, prod_cost_usd, cand_cost_usd)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21)
ON CONFLICT (prod_key, candidate) DO NOTHING`

// runShadow is the shadow job: the candidate's call (a model step of the shadow job,
// through the ledger: a crash after it replays the answer, it is not paid twice), the
// comparison, and the record, committed with the job's completion.
func (c *Client) runShadow(ctx context.Context, job *Job[shadowArgs]) error {
	a := job.Args
	var sh *Shadow
	for i, s := range c.shadows.byStep[a.Step] {
		if s.name() == a.Candidate {
			sh = &c.shadows.byStep[a.Step][i]
		}
	}
	if sh == nil || a.Request == nil || a.Response == nil {
		c.log.InfoContext(ctx, "onceflow: shadow run of a candidate no longer configured; skipped", "step", a.Step, "candidate", a.Candidate)
		return nil
	}
	req := sh.candidateRequest(a.Request)
	start := time.Now()
	// A background call of a tenant of its own: only capacity production does not need,
	// never a production tenant's share or budget.
	st, err := job.run.complete(limiter.WithBackground(limiter.WithTenant(ctx, shadowTenant)), job.ID, "candidate", &req)
	if err != nil {
		return err
	}
	took := time.Since(start)
	var verdict Comparison
	switch {
	case sh.Judge != nil:
		js, err := job.run.complete(limiter.WithBackground(limiter.WithTenant(ctx, shadowTenant)), job.ID, "judge",
			sh.Judge.shadowRequest(a.Request, a.Response, st.Response))
		if err != nil {
			return err
		}
		v := verdictOf(js.Response)
		verdict = Comparison{Agree: v.Score >= sh.Judge.threshold(), Score: v.Score, Detail: v.Reason}
	case sh.Compare != nil:
		verdict = sh.Compare(a.Response, st.Response)
	default:
		verdict = ExactMatch(a.Response, st.Response)
	}
	prodAnswer, candAnswer := answerJSON(a.Response), answerJSON(st.Response)
	pu, cu := a.Response.Usage, st.Response.Usage
	return job.Commit(ctx, func(cm *Commit) error {
		cm.Exec(shadowRunSQL, a.Tenant, a.JobID, a.JobKind, a.Step, a.Candidate, a.Key, pgText(cmp.Or(a.Response.Model, a.Request.Model)),
			pgText(cmp.Or(st.Response.Model, req.Model)), prodAnswer, candAnswer, verdict.Agree, verdict.Score, pgText(verdict.Detail),
			a.LatencyMS, took.Milliseconds(), pu.InputTokens, pu.OutputTokens, cu.InputTokens, cu.OutputTokens,
			c.costUSD(cmp.Or(a.Request.Model, a.Response.Model), pu), c.costUSD(cmp.Or(req.Model, st.Response.Model), cu))
		return nil
	})
}

// answerJSON is r as shadow_runs' jsonb columns take it: U+0000, which jsonb refuses,
// replaced as the ledger replaces it (ledger.JSONBSafe).
func answerJSON(r *llm.Response) []byte {
	b, _ := json.Marshal(r) // plain data: it always encodes
	return ledger.JSONBSafe(b)
}

// shadowTenant is the tenant the limiter sees for shadow calls: a share and a budget
// of their own, never a production tenant's.
const shadowTenant = "onceflow.shadow"

// costUSD prices usage of model by the limiter's price table (limiter.DefaultPrices
// without a limiter); 0 for a model it does not know.
func (c *Client) costUSD(model string, u llm.Usage) float64 {
	if c.model != nil && c.model.limiter != nil {
		usd, _ := c.model.limiter.CostUSD(model, int64(u.InputTokens), int64(u.OutputTokens))
		return usd
	}
	p := limiter.DefaultPrices[model]
	return (float64(u.InputTokens)*p.Input + float64(u.OutputTokens)*p.Output) / 1e6
}

// ShadowQuery selects the shadow runs a report covers (Inspector.ShadowReport).
type ShadowQuery struct {
	// Step, when set, limits the report to that step's shadows.
	Step string
	// Candidate, when set, limits it to that candidate's runs (an evaluation's are
	// "eval:<name>").
	Candidate string
	// Since, when set, limits it to the runs recorded since then.
	Since time.Time
	// Worst is how many of the worst disagreements to return (lowest score first).
	// Default: 5; negative: none.
	Worst int
}

// ShadowSummary is the agreement, cost and latency of one candidate on one step.
type ShadowSummary struct {
	Step      string `json:"step"`
	Candidate string `json:"candidate"`
	// Runs counts the shadow runs, Agreed those that agreed with production;
	// Agreement is Agreed/Runs, Score the mean score.
	Runs      int     `json:"runs"`
	Agreed    int     `json:"agreed"`
	Agreement float64 `json:"agreement"`
	Score     float64 `json:"score"`
	// ProdLatencyMS and CandLatencyMS are the mean latencies of the calls, in ms.
	ProdLatencyMS float64 `json:"prod_latency_ms"`
	CandLatencyMS float64 `json:"cand_latency_ms"`
	// ProdCostUSD and CandCostUSD are the calls' total costs by the price table.
	ProdCostUSD float64 `json:"prod_cost_usd"`
	CandCostUSD float64 `json:"cand_cost_usd"`
	// ProdTokens and CandTokens are the calls' total tokens, input and output.
	ProdTokens int64 `json:"prod_tokens"`
	CandTokens int64 `json:"cand_tokens"`
}

// ShadowDisagreement is one shadow run whose candidate disagreed, with both answers.
type ShadowDisagreement struct {
	Step       string        `json:"step"`
	Candidate  string        `json:"candidate"`
	Tenant     string        `json:"tenant"`
	JobID      string        `json:"job_id"`
	Score      float64       `json:"score"`
	Detail     string        `json:"detail"`
	Production *llm.Response `json:"production"`
	Shadow     *llm.Response `json:"candidate_answer"`
	At         time.Time     `json:"at"`
}

// ShadowReport is what the shadow runs say: a summary per step and candidate, and the
// worst disagreements.
type ShadowReport struct {
	Summaries     []ShadowSummary      `json:"summaries"`
	Disagreements []ShadowDisagreement `json:"disagreements"`
}

// ShadowReport reports the shadow runs q selects (onceflow shadow report, the operator
// UI): per step and candidate, the agreement with production, the mean score, the mean
// latencies and the total costs and tokens of both; and the worst disagreements, both
// answers side by side. Every tenant's runs count. It needs Config.DB.
func (in *Inspector) ShadowReport(ctx context.Context, q ShadowQuery) (*ShadowReport, error) {
	db := in.c.cfg.DB
	if db == nil {
		return nil, errors.New("onceflow: ShadowReport: Config.DB is required (the shadow_runs table is in PostgreSQL)")
	}
	if q.Worst == 0 {
		q.Worst = 5
	}
	since := q.Since
	if since.IsZero() {
		since = time.Unix(0, 0)
	}
	rows, err := db.Query(ctx, `SELECT step, candidate, count(*), count(*) FILTER (WHERE agree), avg(score),
	avg(prod_latency_ms), avg(cand_latency_ms), sum(prod_cost_usd), sum(cand_cost_usd),
	sum(prod_input_tokens + prod_output_tokens), sum(cand_input_tokens + cand_output_tokens)
FROM shadow_runs WHERE ($1 = '' OR step = $1) AND created_at >= $2 AND ($3 = '' OR candidate = $3)
GROUP BY step, candidate ORDER BY step, candidate`, q.Step, since, q.Candidate)
	if err != nil {
		return nil, fmt.Errorf("onceflow: shadow report: %w", err)
	}
	out := &ShadowReport{Summaries: []ShadowSummary{}, Disagreements: []ShadowDisagreement{}}
	for rows.Next() {
		var s ShadowSummary
		if err := rows.Scan(&s.Step, &s.Candidate, &s.Runs, &s.Agreed, &s.Score, &s.ProdLatencyMS, &s.CandLatencyMS,
			&s.ProdCostUSD, &s.CandCostUSD, &s.ProdTokens, &s.CandTokens); err != nil {
			rows.Close()
			return nil, fmt.Errorf("onceflow: shadow report: %w", err)
		}
		s.Agreement = float64(s.Agreed) / float64(max(s.Runs, 1))
		out.Summaries = append(out.Summaries, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflow: shadow report: %w", err)
	}
	if q.Worst < 0 {
		return out, nil
	}
	rows, err = db.Query(ctx, `SELECT step, candidate, tenant, job_id, score, detail, prod_answer, cand_answer, created_at
FROM shadow_runs WHERE NOT agree AND ($1 = '' OR step = $1) AND created_at >= $2 AND ($4 = '' OR candidate = $4)
ORDER BY score, created_at DESC LIMIT $3`, q.Step, since, q.Worst, q.Candidate)
	if err != nil {
		return nil, fmt.Errorf("onceflow: shadow report: %w", err)
	}
	for rows.Next() {
		var d ShadowDisagreement
		var prod, cand []byte
		if err := rows.Scan(&d.Step, &d.Candidate, &d.Tenant, &d.JobID, &d.Score, &d.Detail, &prod, &cand, &d.At); err != nil {
			rows.Close()
			return nil, fmt.Errorf("onceflow: shadow report: %w", err)
		}
		d.Production, d.Shadow = &llm.Response{}, &llm.Response{}
		_ = json.Unmarshal(prod, d.Production)
		_ = json.Unmarshal(cand, d.Shadow)
		out.Disagreements = append(out.Disagreements, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflow: shadow report: %w", err)
	}
	return out, nil
}
