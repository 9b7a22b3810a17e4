package onceflow

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/internal/metrics"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/retry"
)

// Gate checks a model step's answer before the job acts on it (Config.Gates). An answer
// that fails the check is asked again of Fallback, when set; an answer that still fails
// holds the job: it parks, holding no worker, before any of its effects (its Commit has
// not run), JobState says StatusHeld, and an operator decides (Client.Release: the job
// goes on with the held answer, and its effects happen once; Client.RejectHeld: the job
// fails with the gate's reason, nothing sent). See docs/shadows.md#eval-gates.
type Gate struct {
	// Step is the step's name as the job gives it to Job.Complete or Job.Stream.
	// Required.
	Step string
	// Kind, when set, limits the gate to the steps of jobs of that kind.
	Kind string
	// Name names the gate in metrics, in JobState.Waiting and to operators. Default:
	// Step.
	Name string
	// Check returns nil for an answer that passes, else why it fails. Optional.
	Check func(resp *llm.Response) error
	// Schema, when set, is a JSON Schema (draft 2020-12 or 7) the answer's text must
	// satisfy, as JSON: structured output.
	Schema json.RawMessage
	// Judge, when set, has a model grade the answer by Judge.Criteria; the answer fails
	// below Judge.Threshold. The judge's call is a model step of the job
	// ("<Step>.judge", "<Step>.fallback.judge" for the fallback's answer), recorded in
	// the ledger: a redelivery replays its verdict. It runs after Schema and Check pass.
	Judge *Judge
	// Fallback, when set, is the model the same request is asked of when the answer
	// fails, as the step "<Step>.fallback"; its answer is checked too. It applies to
	// Job.Complete; a streamed step (Job.Stream), whose text the job has seen, is held.
	Fallback string
	// Timeout is how long a held job waits for an operator; then it is rejected.
	// Default: DefaultApprovalTimeout.
	Timeout time.Duration

	schema *jsonschema.Resolved
}

// name is the gate's name: Name, else Step.
func (g *Gate) name() string {
	if g.Name != "" {
		return g.Name
	}
	return g.Step
}

// StatusHeld: a job whose model answer failed an eval gate waits for an operator
// (Client.Release, Client.RejectHeld) before its effects; Waiting says
// "signal gate:<the held answer's key>".
const StatusHeld Status = "held"

// gatePrefix names a held answer's wait and decision: "gate:" and the answer's ledger key.
const gatePrefix = "gate:"

// gates is the Client's eval gates by step, with their metrics.
type gates struct {
	byStep  map[string][]*Gate
	outcome *prometheus.CounterVec
}

// setupGates checks Config.Gates.
func setupGates(cfg *Config) (*gates, error) {
	if len(cfg.Gates) == 0 {
		return nil, nil
	}
	if cfg.DB == nil {
		return nil, errors.New("onceflow: Config.Gates need Config.DB (a held job's decision is in PostgreSQL)")
	}
	g := &gates{byStep: map[string][]*Gate{}}
	for i := range cfg.Gates {
		gate := cfg.Gates[i] // a copy: the caller's Config is not changed
		if err := checkStepName(gate.Step); err != nil {
			return nil, fmt.Errorf("onceflow: Config.Gates: gate of step %q: %w", clipText(gate.Step), err)
		}
		if gate.Check == nil && len(gate.Schema) == 0 && gate.Judge == nil {
			return nil, fmt.Errorf("onceflow: Config.Gates: gate of step %q checks nothing: give it a Check, a Schema or a Judge", gate.Step)
		}
		if gate.Judge != nil {
			if err := gate.Judge.check(true); err != nil {
				return nil, fmt.Errorf("onceflow: Config.Gates: gate of step %q: %w", gate.Step, err)
			}
			j := *gate.Judge // a copy too
			gate.Judge = &j
		}
		if !printableName(gate.name(), 64) {
			return nil, fmt.Errorf("onceflow: Config.Gates: gate name %q: want 1 to 64 printable ASCII characters", clipText(gate.name()))
		}
		if gate.Timeout < 0 || gate.Timeout > MaxWaitTimeout {
			return nil, fmt.Errorf("onceflow: Config.Gates: gate %q: timeout %v is not between 0 and %v", gate.name(), gate.Timeout, MaxWaitTimeout)
		}
		if len(gate.Schema) > 0 {
			var s jsonschema.Schema
			if err := json.Unmarshal(gate.Schema, &s); err != nil {
				return nil, fmt.Errorf("onceflow: Config.Gates: gate %q: schema: %w", gate.name(), err)
			}
			rs, err := s.Resolve(nil)
			if err != nil {
				return nil, fmt.Errorf("onceflow: Config.Gates: gate %q: schema: %w", gate.name(), err)
			}
			gate.schema = rs
		}
		g.byStep[gate.Step] = append(g.byStep[gate.Step], &gate)
	}
	g.outcome = metrics.Register(cfg.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Subsystem: "gate", Name: "answers_total",
		Help: "Model answers an eval gate checked, by gate, step and outcome: passed, failed, fallback_passed, held, released, rejected.",
	}, []string{"gate", "step", "outcome"}))
	return g, nil
}

// check returns why resp fails g, or nil.
func (g *Gate) check(resp *llm.Response) error {
	if g.schema != nil {
		var v any
		if err := json.Unmarshal([]byte(resp.Content), &v); err != nil {
			return fmt.Errorf("the answer is not JSON: %w", err)
		}
		if err := g.schema.Validate(v); err != nil {
			return fmt.Errorf("the answer does not match the schema: %w", err)
		}
	}
	if g.Check != nil {
		return g.Check(resp)
	}
	return nil
}

// evaluate returns why step's answer s (to req) fails g, or nil: g's Schema and Check,
// then its Judge, whose call is the job's model step "<step>.judge". err is the judge
// call's error (the delivery fails as a model step's would).
func (rt *runtime) evaluate(ctx context.Context, jobID, step string, g *Gate, req *llm.Request, s *Step) (why, err error) {
	if why := g.check(s.Response); why != nil || g.Judge == nil {
		return why, nil
	}
	js, err := rt.complete(ctx, jobID, step+".judge", g.Judge.gateRequest(req, s.Response))
	if err != nil {
		return nil, err
	}
	v, bad := ParseVerdict(js.Response.Content)
	switch {
	case bad != nil: // held for a person: an unjudged answer does not go through
		return fmt.Errorf("the judge %s gave no verdict: %w", g.Judge.Model, bad), nil
	case v.Score < g.Judge.threshold():
		return fmt.Errorf("the judge %s scored it %.2f, below %.2f: %s", g.Judge.Model, v.Score, g.Judge.threshold(), v.Reason), nil
	}
	return nil, nil
}

// gate runs the eval gates of step on s's answer: it returns the step to act on (s, or
// the fallback's), or the error that holds the job (a *retry.WaitError while an
// operator has not decided) or fails it (ErrGateRejected, permanent). Every gate of the
// step checks the answer; those that fail hold it together, under one decision, so an
// operator sees every reason and one release or rejection settles them all.
func (rt *runtime) gate(ctx context.Context, jobID, step string, req *llm.Request, s *Step, streamed bool) (*Step, error) {
	c := rt.client
	if c.gates == nil || rt.delivery == nil || rt.delivery.Kind == ShadowKind { // a shadow has no effects to hold
		return s, nil
	}
	var gs []*Gate
	for _, g := range c.gates.byStep[step] {
		if g.Kind == "" || g.Kind == rt.delivery.Kind {
			gs = append(gs, g)
		}
	}
	failed, whys, err := rt.evaluateAll(ctx, jobID, step, gs, req, s, true)
	if err != nil || len(failed) == 0 {
		return s, err
	}
	why := joinWhys(failed, whys)
	if i := slices.IndexFunc(failed, func(g *Gate) bool { return g.Fallback != "" }); i >= 0 && !streamed { // a stream's consumer has its text already
		fr := *req
		fr.Model = failed[i].Fallback
		fs, err := rt.complete(ctx, jobID, step+".fallback", &fr)
		if err != nil {
			return nil, err
		}
		ffailed, fwhys, err := rt.evaluateAll(ctx, jobID, step+".fallback", gs, &fr, fs, false)
		if err != nil {
			return nil, err
		}
		if len(ffailed) == 0 {
			c.gates.count(failed, step, "fallback_passed")
			return fs, nil
		}
		why = fmt.Errorf("%w; the fallback %s's answer too: %w", why, fr.Model, joinWhys(ffailed, fwhys))
	}
	d, err := rt.hold(ctx, failed, s.Key, why)
	if err != nil {
		var we *retry.WaitError
		if errors.As(err, &we) {
			c.gates.count(failed, step, "held")
		}
		return nil, err
	}
	if !d.Approved {
		c.gates.count(failed, step, "rejected")
		return nil, retry.Permanent(fmt.Errorf("%w: gate %s: %s (%s)", ErrGateRejected, gateNames(failed), why, heldWords(d)))
	}
	c.gates.count(failed, step, "released")
	return s, nil
}

// evaluateAll checks s's answer against every gate in gs and returns those it fails
// with why, counting passed and failed when count is set; err is
// a judge call's.
func (rt *runtime) evaluateAll(ctx context.Context, jobID, step string, gs []*Gate, req *llm.Request, s *Step, count bool) (failed []*Gate, whys []error, err error) {
	for _, g := range gs {
		why, err := rt.evaluate(ctx, jobID, step, g, req, s)
		if err != nil {
			return nil, nil, err
		}
		outcome := "passed"
		if why != nil {
			outcome = "failed"
			failed, whys = append(failed, g), append(whys, why)
		}
		if count {
			rt.client.gates.count([]*Gate{g}, step, outcome)
		}
	}
	return failed, whys, nil
}

// joinWhys is why the gates gs failed (whys, one per gate) on one line: the one reason,
// or each gate's named, "; " between them.
func joinWhys(gs []*Gate, whys []error) error {
	if len(whys) == 1 {
		return whys[0]
	}
	msgs := make([]string, len(whys))
	for i, w := range whys {
		msgs[i] = "gate " + gs[i].name() + ": " + w.Error()
	}
	return errors.New(strings.Join(msgs, "; "))
}

// count adds one to outcome's count of each gate in gs on step.
func (g *gates) count(gs []*Gate, step, outcome string) {
	for _, gate := range gs {
		g.outcome.WithLabelValues(gate.name(), step, outcome).Inc()
	}
}

// gateNames names the gates gs, comma-separated.
func gateNames(gs []*Gate) string {
	names := make([]string, len(gs))
	for i, g := range gs {
		names[i] = g.name()
	}
	return strings.Join(names, ", ")
}

// hold parks the job on the decision about the answer key that failed the gates gs
// (why), as an approval does: the decision is recorded against the answer's ledger key,
// so a resumed job never asks twice, and another answer (a new request) is a new
// decision. It waits the shortest of the gates' timeouts.
func (rt *runtime) hold(ctx context.Context, gs []*Gate, key string, why error) (*Decision, error) {
	timeout := time.Duration(0)
	for _, g := range gs {
		t := cmp.Or(g.Timeout, DefaultApprovalTimeout)
		if timeout == 0 || t < timeout {
			timeout = t
		}
	}
	name := gatePrefix + key
	out, err := rt.wait(ctx, name, timeout, waitRecord{Tool: gateNames(gs), Arguments: gateReason(why)})
	if err != nil {
		return nil, err // a *retry.WaitError parks the job: JobState says held
	}
	return rt.decisionOf(ctx, name, out, false, "gate "+strconv.Quote(gateNames(gs)))
}

// maxHeldReason bounds the reason a hold records (Held.Reason), in bytes, "..." aside.
const maxHeldReason = 1000

// gateReason is why's text as a hold records it, in a text column that refuses invalid
// UTF-8 and U+0000: PostgreSQL text (pgText), clipped to maxHeldReason bytes at a
// character's boundary.
func gateReason(why error) string {
	return clipRunes(pgText(why.Error()), maxHeldReason)
}

// pgText is s as PostgreSQL's text and jsonb accept it: invalid UTF-8 and U+0000 (which
// a model's answer, or an error quoting it, may hold) become U+FFFD.
func pgText(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// Held is a job an eval gate holds (Inspector.Held).
type Held struct {
	Tenant string `json:"tenant"`
	JobID  string `json:"job_id"`
	// Key is the held answer's ledger key, which Release and RejectHeld take.
	Key string `json:"key"`
	// Gate names the gates the answer failed, comma-separated; Reason says why, gate by
	// gate.
	Gate     string    `json:"gate"`
	Reason   string    `json:"reason"`
	HeldAt   time.Time `json:"held_at"`
	Deadline time.Time `json:"deadline"`
}

// Held lists up to limit jobs an eval gate holds, oldest first: of tenant, or of every
// tenant when all is set (the operators' list).
func (in *Inspector) Held(ctx context.Context, tenant string, all bool, limit int) ([]Held, error) {
	return pendingWaits(ctx, in.c.steps, gatePrefix, tenant, all, limit, func(p pendingWait) Held {
		return Held{Tenant: p.tenant, JobID: p.job, Key: p.key, Gate: p.tool, Reason: p.args, HeldAt: p.at, Deadline: p.rec.Deadline}
	})
}

// Release decides that tenant's job id, held by an eval gate on its answer key
// (Held.Key), goes on with that answer: the job is woken and its effects happen, once.
// As with Approve, the same decision again is a retry (nil, the job woken again); the
// other one, a hold its timeout decided, or none is ErrNotWaiting.
func (c *Client) Release(ctx context.Context, tenant, id, key, by, note string) error {
	_, _, err := c.decideOn(ctx, tenant, id, gatePrefix, key, Decision{Approved: true, By: by, Note: note})
	return err
}

// RejectHeld decides that tenant's job id, held by an eval gate on its answer key, must
// not go on: it fails with the gate's reason (dead-lettered, ErrGateRejected), and
// nothing of it is sent. See Release.
func (c *Client) RejectHeld(ctx context.Context, tenant, id, key, by, note string) error {
	_, _, err := c.decideOn(ctx, tenant, id, gatePrefix, key, Decision{By: by, Note: note})
	return err
}

// validGateKey reports whether key is a held answer's key: a ledger key.
func validGateKey(key string) bool {
	return strings.HasPrefix(key, ledger.KeyPrefix) && len(key) <= 200
}

// heldWords says how a hold was decided: by whom, with the note, or by its timeout.
func heldWords(d *Decision) string {
	w := decisionWords(d)
	if d.By != "" {
		w += " by " + d.By
	}
	if d.Note != "" {
		w += ": " + d.Note
	}
	return w
}
