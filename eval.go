package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// Eval is an offline evaluation (Client.Eval): the production calls of a step that the
// ledger recorded with their requests (ledger.Config.KeepRequests) are asked again of a
// candidate, and each answer is compared with production's and recorded in shadow_runs
// as a shadow's is, under the candidate name "eval:<name>", so `onceflow shadow report`
// and the UI report it beside the live shadows.
type Eval struct {
	// Step is the production step whose recorded calls are replayed. Required.
	Step string
	// Candidate is what the inputs are asked of, as for a shadow: Model, Name,
	// Transform, and Compare or Judge (its Step, Kind and Rate are not used).
	Candidate Shadow
	// Since is how far back the inputs go. Default: 24h (the ledger keeps
	// ledger.Config.Retention of calls, a day by default).
	Since time.Duration
	// Tenant, when set, limits the inputs to that tenant's calls.
	Tenant string
	// Limit is how many inputs at most, oldest first. Default: 100; at most MaxEvalInputs.
	Limit int
	// MaxCostUSD stops the evaluation once its calls (the candidate's and the judge's)
	// cost that much by the limiter's price table; the inputs left are not asked. 0: no
	// bound but the limiter's (the tenant "onceflow.eval"'s token budget, when set).
	MaxCostUSD float64
	// Concurrency is how many inputs are asked at once. Default: 4; at most 32.
	Concurrency int
}

// MaxEvalInputs bounds Eval.Limit.
const MaxEvalInputs = 10000

// evalPrefix starts the candidate name an evaluation records its runs under.
const evalPrefix = "eval:"

// evalTenant is the tenant the limiter sees for an evaluation's calls.
const evalTenant = "onceflow.eval"

// EvalResult is what an evaluation did, and its report.
type EvalResult struct {
	// Candidate is the name the runs are recorded under: "eval:" and the candidate's.
	Candidate string `json:"candidate"`
	// Inputs counts the recorded production calls found that this candidate had not
	// been asked yet; Recorded, the runs recorded; Failed, the inputs whose candidate
	// (or judge) call failed, which a later evaluation asks again.
	Inputs   int `json:"inputs"`
	Recorded int `json:"recorded"`
	Failed   int `json:"failed"`
	// Errors are the first few failures, for the operator.
	Errors []string `json:"errors,omitempty"`
	// CostUSD is what the evaluation's calls cost by the price table.
	CostUSD float64 `json:"cost_usd"`
	// Stopped says why inputs were left unasked ("" when none were): the budget.
	Stopped string `json:"stopped,omitempty"`
	// Report is the step's report for this candidate: every run recorded under its name,
	// this evaluation's and earlier ones'.
	Report *ShadowReport `json:"report"`
}

// evalInput is one recorded production call.
type evalInput struct {
	key, work, tenant, model string
	request                  *llm.Request
	response                 *llm.Response
}

// evalInputsSQL selects the step's recorded production calls that the candidate has
// not answered yet, oldest first.
//
//	$1 the step as ledger.Work escapes it, $2 since, $3 tenant ("" every tenant),
//	$4 the candidate's recorded name, $5 limit
const evalInputsSQL = `SELECT c.idem_key, c.work, c.tenant, c.model, c.request, c.response FROM llm_calls c
WHERE c.state = 'succeeded' AND c.request IS NOT NULL AND c.response IS NOT NULL
	AND split_part(c.work, '/', 1) = $1 AND c.created_at >= $2 AND ($3 = '' OR c.tenant = $3)
	AND NOT EXISTS (SELECT 1 FROM shadow_runs s WHERE s.prod_key = c.idem_key AND s.candidate = $4)
ORDER BY c.created_at LIMIT $5`

// Eval runs an offline evaluation (see Eval; `onceflow eval`): each input is asked of
// the candidate once, through the ledger with keys of its own (work "eval:<name>/<the
// production call's key>"), so an evaluation run again, or resumed after a crash,
// replays the answers it has instead of paying for them again, and records each run
// once. The calls are background calls of the tenant "onceflow.eval" under the
// limiter: they take only the capacity production leaves, and wait for it. It needs
// Config.Model and Config.DB. An input whose call fails is counted, not recorded, and
// the evaluation goes on; its error is for the database, ctx, or a bad Eval.
func (c *Client) Eval(ctx context.Context, e Eval) (*EvalResult, error) {
	if c.model == nil || c.cfg.DB == nil {
		return nil, errors.New("onceflow: Eval needs Config.Model and Config.DB (the inputs are in the ledger)")
	}
	sh := e.Candidate
	sh.Step, sh.Kind, sh.Rate = e.Step, "", 1
	if err := sh.check(); err != nil {
		return nil, fmt.Errorf("onceflow: Eval: %w", err)
	}
	switch {
	case e.Since < 0:
		return nil, fmt.Errorf("onceflow: Eval: Since %v must not be negative", e.Since)
	case e.Limit < 0 || e.Limit > MaxEvalInputs:
		return nil, fmt.Errorf("onceflow: Eval: Limit %d is not between 0 and %d", e.Limit, MaxEvalInputs)
	case e.MaxCostUSD < 0:
		return nil, fmt.Errorf("onceflow: Eval: MaxCostUSD %v must not be negative", e.MaxCostUSD)
	case e.Concurrency < 0 || e.Concurrency > 32:
		return nil, fmt.Errorf("onceflow: Eval: Concurrency %d is not between 0 and 32", e.Concurrency)
	}
	name := evalPrefix + sh.name()
	if !printableName(name, 64) {
		return nil, fmt.Errorf("onceflow: Eval: candidate name %q: want at most %d printable ASCII characters", clipText(sh.name()), 64-len(evalPrefix))
	}
	inputs, err := c.evalInputs(ctx, e, name)
	if err != nil {
		return nil, err
	}
	res := &EvalResult{Candidate: name, Inputs: len(inputs)}
	var mu sync.Mutex
	next := 0
	var wg sync.WaitGroup
	for range cmp.Or(e.Concurrency, 4) {
		wg.Go(func() {
			for {
				mu.Lock()
				if next == len(inputs) || ctx.Err() != nil || res.Stopped != "" {
					mu.Unlock()
					return
				}
				if e.MaxCostUSD > 0 && res.CostUSD >= e.MaxCostUSD {
					res.Stopped = fmt.Sprintf("the budget of %.4f USD was spent with %d inputs left", e.MaxCostUSD, len(inputs)-next)
					mu.Unlock()
					return
				}
				in := inputs[next]
				next++
				mu.Unlock()
				cost, err := c.evalOne(ctx, &sh, name, in)
				mu.Lock()
				res.CostUSD += cost
				if err != nil {
					res.Failed++
					if len(res.Errors) < 5 {
						res.Errors = append(res.Errors, fmt.Sprintf("%s: %v", in.key, err))
					}
				} else {
					res.Recorded++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return res, fmt.Errorf("onceflow: Eval: %w", err)
	}
	rep, err := c.Inspector().ShadowReport(ctx, ShadowQuery{Step: e.Step, Candidate: name})
	if err != nil {
		return res, err
	}
	res.Report = rep
	return res, nil
}

// evalInputs reads the inputs e selects that candidate has not answered.
func (c *Client) evalInputs(ctx context.Context, e Eval, candidate string) ([]evalInput, error) {
	since := time.Now().Add(-cmp.Or(e.Since, 24*time.Hour))
	rows, err := c.cfg.DB.Query(ctx, evalInputsSQL, url.PathEscape(e.Step), since, e.Tenant, candidate, cmp.Or(e.Limit, 100))
	if err != nil {
		return nil, fmt.Errorf("onceflow: Eval: reading the recorded calls: %w", PostgresError(err))
	}
	defer rows.Close()
	var out []evalInput
	for rows.Next() {
		var in evalInput
		var req, resp []byte
		if err := rows.Scan(&in.key, &in.work, &in.tenant, &in.model, &req, &resp); err != nil {
			return nil, fmt.Errorf("onceflow: Eval: reading the recorded calls: %w", PostgresError(err))
		}
		if json.Unmarshal(req, &in.request) != nil || json.Unmarshal(resp, &in.response) != nil || in.request == nil || in.response == nil {
			c.log.WarnContext(ctx, "onceflow: Eval: a recorded call does not decode; skipped", "key", in.key)
			continue
		}
		out = append(out, in)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflow: Eval: reading the recorded calls: %w", PostgresError(err))
	}
	return out, nil
}

// evalOne asks in of the candidate sh (and its judge), records the run under name, and
// returns what the calls cost.
func (c *Client) evalOne(ctx context.Context, sh *Shadow, name string, in evalInput) (float64, error) {
	req := sh.candidateRequest(in.request)
	req.IdempotencyKey = ledger.Work(in.key, name)
	ctx = limiter.WithBackground(limiter.WithTenant(ctx, evalTenant))
	start := time.Now()
	resp, err := c.evalCall(ctx, &req)
	if err != nil {
		return 0, err
	}
	took := time.Since(start)
	cost := c.costUSD(cmp.Or(req.Model, resp.Model), resp.Usage)
	var verdict Comparison
	switch {
	case sh.Judge != nil:
		jr := sh.Judge.shadowRequest(in.request, in.response, resp)
		jr.IdempotencyKey = ledger.Work(in.key, name+".judge")
		js, err := c.evalCall(ctx, jr)
		if err != nil {
			return cost, fmt.Errorf("the judge: %w", err)
		}
		cost += c.costUSD(cmp.Or(jr.Model, js.Model), js.Usage)
		v := verdictOf(js)
		verdict = Comparison{Agree: v.Score >= sh.Judge.threshold(), Score: v.Score, Detail: v.Reason}
	case sh.Compare != nil:
		verdict = sh.Compare(in.response, resp)
	default:
		verdict = ExactMatch(in.response, resp)
	}
	prodAnswer, candAnswer := answerJSON(in.response), answerJSON(resp)
	pu, cu := in.response.Usage, resp.Usage
	jobID := in.work[strings.IndexByte(in.work, '/')+1:]
	_, err = c.cfg.DB.Exec(ctx, shadowRunSQL, in.tenant, jobID, "", sh.Step, name, in.key,
		pgText(cmp.Or(in.response.Model, in.model)), pgText(cmp.Or(resp.Model, req.Model)), prodAnswer, candAnswer, verdict.Agree, verdict.Score,
		pgText(verdict.Detail), 0, took.Milliseconds(), pu.InputTokens, pu.OutputTokens, cu.InputTokens, cu.OutputTokens,
		c.costUSD(cmp.Or(in.model, in.response.Model), pu), c.costUSD(cmp.Or(req.Model, resp.Model), cu))
	if err != nil {
		return cost, fmt.Errorf("recording the run: %w", PostgresError(err))
	}
	return cost, nil
}

// evalCall makes one model call of an evaluation through the ledger and the limiter,
// with the model's retry policy, waiting as long as the limiter puts it off (ctx
// bounds the wait).
func (c *Client) evalCall(ctx context.Context, req *llm.Request) (*llm.Response, error) {
	m := c.model
	for {
		resp, err := retry.Do(ctx, m.policy, retry.Deadline{}, func(ctx context.Context) (*llm.Response, error) {
			return m.client.Complete(ctx, req)
		})
		var we *retry.WaitError
		if !errors.As(err, &we) {
			return resp, err
		}
		t := time.NewTimer(we.Delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
}
