package chaos

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/queue"
)

// AgentConfig sets up an agent chaos run (RunAgent): examples/agent's program as its
// three roles, each a process of its own (AGENT_ROLE api, work and relay), with kill -9
// of every role, a Redis kill and a PostgreSQL restart, and a model that gives every
// answer new tool-call ids.
type AgentConfig struct {
	// Config is the run's: Bin is the examples/agent binary; Clients are customers.
	// Defaults as Config's but Duration 60s, Clients 4, Think 150ms and KillMax 2.5s;
	// PoisonRate is not used.
	Config
	// ApprovalRate is the share of refunds above the approval threshold (the job waits
	// for the operator); RejectRate the share of those the operator rejects. Defaults:
	// 0.3 and 0.4.
	ApprovalRate, RejectRate float64
}

// approvalAbove is the run's REFUND_APPROVAL_ABOVE, in cents.
const approvalAbove = 10000

// AgentReport is the outcome of an agent chaos run.
type AgentReport struct {
	Seed     uint64
	Duration time.Duration
	// Jobs counts the support requests the customers sent; Accepted those acknowledged
	// with 202; Requests the POSTs (retries included).
	Jobs, Accepted int
	Requests       int64
	// Approvals counts the refunds that waited for the operator; Approved and Rejected
	// the decisions recorded; Retried the decisions the operator sent again (answered
	// as the first), Conflicting the opposite decisions it tried after one was
	// recorded (each refused with 409).
	Approvals, Approved, Rejected, Retried, Conflicting int
	// Refunds counts the distinct refund keys the payments API got, RefundPOSTs its
	// POSTs (a key sent again is one refund: the API honours the key).
	Refunds, RefundPOSTs int
	// Emails counts the distinct email keys the mailer got, EmailPOSTs its POSTs.
	Emails, EmailPOSTs int
	// Replies counts the rows of the replies table.
	Replies int
	// ModelRequests and OrderReads are the model's and the orders API's requests.
	ModelRequests, OrderReads int64
	// TakenOver counts the model calls a later attempt took over (the ledger's attempt
	// above 1: after a kill, a 429 or a 503).
	TakenOver  int
	Events     []string
	Violations []string
}

// Failed reports whether an invariant was violated.
func (r *AgentReport) Failed() bool { return len(r.Violations) > 0 }

// String renders the report: figures, then violations, then the event log.
func (r *AgentReport) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "agent chaos run seed=%d duration=%s\n", r.Seed, r.Duration)
	fmt.Fprintf(&b, "  support requests %d, accepted %d, POSTs %d\n", r.Jobs, r.Accepted, r.Requests)
	fmt.Fprintf(&b, "  approvals %d: approved %d, rejected %d; decisions retried %d, opposite decisions refused %d\n",
		r.Approvals, r.Approved, r.Rejected, r.Retried, r.Conflicting)
	fmt.Fprintf(&b, "  refunds %d (POSTs %d), emails %d (POSTs %d), replies rows %d\n", r.Refunds, r.RefundPOSTs, r.Emails, r.EmailPOSTs, r.Replies)
	perJob := func(n int64) float64 {
		if r.Accepted == 0 {
			return 0
		}
		return float64(n) / float64(r.Accepted)
	}
	fmt.Fprintf(&b, "  model requests %d (%.2f per job; %d calls taken over by a later attempt), order reads %d (%.2f per job)\n",
		r.ModelRequests, perJob(r.ModelRequests), r.TakenOver, r.OrderReads, perJob(r.OrderReads))
	fmt.Fprintf(&b, "  faults: %d events\n", len(r.Events))
	writeVerdict(&b, r.Violations, r.Events, fmt.Sprintf("make chaos-agent CHAOS_SEED=%d", r.Seed))
	return b.String()
}

const (
	agentKey   = "chaos-agent-key-0123456789"
	agentAdmin = "chaos-agent-admin-0123456789"
)

// supportOrder is one customer request: its order, the refund the customer asks for
// and, when it needs approval, what the operator decides.
type supportOrder struct {
	order   string
	key     string // Idempotency-Key
	email   string
	amount  int
	approve bool // the operator's decision (amount > approvalAbove)
	jobID   string
}

// agentRun is one agent chaos run's state.
type agentRun struct {
	cfg   AgentConfig
	rng   *rand.Rand
	start time.Time

	redis *cluster.Server
	pg    *cluster.Server
	roles []*cluster.Proc // api, work-1, work-2, relay
	api   *cluster.Proc
	env   []string

	apiURL   string
	model    *fakeserver.Server
	payments *webhooksink.Sink
	mailer   *webhooksink.Sink
	servers  []*http.Server
	reads    atomic.Int64

	evMu   sync.Mutex
	events []string

	mu       sync.Mutex
	orders   map[string]*supportOrder // by order id
	accepted map[string]*supportOrder // by job id
	rejected []string
	jobs     atomic.Int64
	requests atomic.Int64

	// The operator's decisions: recorded (200 to its first decision), retried (200 and
	// Idempotent-Replayed to the same again), conflicting (409 to the opposite).
	decided              map[string]bool // approval key -> recorded
	retried, conflicting atomic.Int64
	decisionViolations   []string
	operatorDone         chan struct{}
	operatorStop         context.CancelFunc
	operatorHTTP         *http.Client
	customerHTTP         *http.Client
}

// RunAgent performs one agent chaos run and returns its report; an error means the run
// itself could not be carried out (a process would not start), not that an invariant
// failed.
//
// Customers POST support requests (each about an order of its own, asking for a refund)
// with idempotency keys, retried with the same key until a final answer; the model
// looks the order up, refunds, answers; the orders API's answer changes at every read;
// refunds above the threshold wait for the operator, who lists the approvals and decides
// each (approve or reject, from the seed), sometimes sending the same decision again or
// the opposite one. Meanwhile a seeded scheduler kill -9s the API, a worker or the relay
// every KillMin..KillMax and restarts it, kills Redis (appendfsync always) once and
// restarts PostgreSQL in immediate mode once. Then the faults stop, every job finishes,
// and it checks: every accepted job done once (one completion, one replies row, one
// email key, nothing dead-lettered); every refund made once (one payments key per
// refunded order, none for a rejected one); every approval decided once, as the
// operator decided (one decision record, every opposite decision refused).
func RunAgent(ctx context.Context, cfg AgentConfig) (*AgentReport, error) {
	cfg.Duration = cmp.Or(cfg.Duration, 60*time.Second)
	cfg.Clients = cmp.Or(cfg.Clients, 4)
	cfg.Think = cmp.Or(cfg.Think, 150*time.Millisecond)
	cfg.KillMax = cmp.Or(cfg.KillMax, 2500*time.Millisecond)
	var err error
	if cfg.Config, err = cfg.Config.withDefaults(); err != nil {
		return nil, err
	}
	cfg.ApprovalRate = cmp.Or(cfg.ApprovalRate, 0.3)
	cfg.RejectRate = cmp.Or(cfg.RejectRate, 0.4)
	r := &agentRun{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0xa6e)), start: time.Now(), // #nosec G404 -- a seeded, replayable schedule, not a secret
		orders: map[string]*supportOrder{}, accepted: map[string]*supportOrder{}, decided: map[string]bool{},
		operatorHTTP: &http.Client{Timeout: 5 * time.Second}, customerHTTP: &http.Client{Timeout: 5 * time.Second}}
	defer r.stopAll()
	if err := r.setup(ctx); err != nil {
		return nil, err
	}
	r.logf("seed %d: load and faults for %s with %d customers", cfg.Seed, cfg.Duration, cfg.Clients)
	octx, ostop := context.WithCancel(ctx)
	r.operatorStop, r.operatorDone = ostop, make(chan struct{})
	go func() { defer close(r.operatorDone); r.operator(octx) }()

	loadCtx, stopLoad := context.WithTimeout(ctx, cfg.Duration)
	defer stopLoad()
	var wg sync.WaitGroup
	for c := range cfg.Clients {
		rng := rand.New(rand.NewPCG(cfg.Seed, uint64(c+1))) // #nosec G404 G115 -- seeded customer behaviour; c is a small count
		wg.Go(func() { r.customer(loadCtx, c, rng) })
	}
	if err := r.faults(loadCtx); err != nil {
		return nil, err
	}
	for _, p := range r.roles {
		if !p.Running() {
			r.event("%s was not running after the faults (see %s); restarting", p.Name, p.LogPath())
			if err := p.Start(); err != nil {
				return nil, err
			}
		}
	}
	wg.Wait()
	r.logf("faults stopped; %d requests accepted; draining", len(r.accepted))
	rep, err := r.drainAndCheck(ctx)
	if err != nil {
		return nil, err
	}
	rep.Duration = time.Since(r.start).Round(time.Second)
	return rep, nil
}

func (r *agentRun) logf(format string, args ...any) {
	fmt.Fprintf(r.cfg.Log, "[%6.1fs] %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func (r *agentRun) event(format string, args ...any) {
	e := fmt.Sprintf("%7.2fs %s", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
	r.evMu.Lock()
	r.events = append(r.events, e)
	r.evMu.Unlock()
	fmt.Fprintf(r.cfg.Log, "[%6.1fs] fault: %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

// serve serves h on a free loopback port until the run ends and returns its URL.
func (r *agentRun) serve(h http.Handler) (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	r.servers = append(r.servers, srv)
	go func() { _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String(), nil
}

// userMessage is how a customer asks; the fake model reads the order and the amount
// back from the conversation's user message ("Order O-1. Please refund 1234 cents.").
var userMessage = regexp.MustCompile(`^Order ([A-Za-z0-9_-]+)\. Please refund (\d+) cents\.`)

// script is the model's agent loop, by the tool results in the conversation: look the
// order up, refund the amount asked, then answer in text.
func script(req *llm.Request) (string, json.RawMessage, bool) {
	var m []string
	results := 0
	for _, msg := range req.Messages {
		switch msg.Role {
		case llm.RoleUser:
			m = userMessage.FindStringSubmatch(msg.Content)
		case llm.RoleTool:
			results++
		}
	}
	if m == nil {
		return "", nil, false
	}
	switch results {
	case 0:
		return "lookup_order", fmt.Appendf(nil, `{"order":%q}`, m[1]), true
	case 1:
		return "issue_refund", fmt.Appendf(nil, `{"order":%q,"amount":%s}`, m[1], m[2]), true
	}
	return "", nil, false
}

// setup starts the stores, the outside world (model, orders and payments APIs, mailer)
// in this process, and the program's roles.
func (r *agentRun) setup(ctx context.Context) error {
	var err error
	if r.redis, err = cluster.NewRedis(r.cfg.Dir, "always"); err != nil {
		return err
	}
	if err := r.redis.Up(); err != nil {
		return err
	}
	if r.pg, err = cluster.NewPostgres(r.cfg.Dir); err != nil {
		return err
	}
	if err := r.pg.Up(); err != nil {
		return err
	}
	if r.model, err = fakeserver.New(fakeserver.Config{ToolCallIDs: fakeserver.ToolCallIDsRandom, ToolChoice: script,
		Latency: 40 * time.Millisecond, Fail429: 0.02, Fail503: 0.02, Seed: r.cfg.Seed}); err != nil { // kills land mid-loop
		return err
	}
	modelURL, err := r.serve(r.model)
	if err != nil {
		return err
	}
	orders := http.NewServeMux()
	orders.HandleFunc("GET /orders/{id}", func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Query().Get("fields") == "customer" { // the refund's check of the order's customer
			fmt.Fprintf(w, `{"customer":"acme"}`)
			return
		}
		n := r.reads.Add(1) // updated_at changes at every read
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"order": req.PathValue("id"), "customer": "acme", "status": "delivered",
			"amount_paid": 60000, "updated_at": time.Now().UTC().Format(time.RFC3339Nano), "read": n})
	})
	ordersURL, err := r.serve(orders)
	if err != nil {
		return err
	}
	r.payments = webhooksink.New(webhooksink.Options{Seed: r.cfg.Seed})
	r.payments.SetAnswer(func(key string, _ []byte) []byte {
		return fmt.Appendf(nil, `{"refund_id":"re_%s","status":"succeeded"}`, key[max(0, len(key)-12):])
	})
	paymentsURL, err := r.serve(r.payments)
	if err != nil {
		return err
	}
	r.mailer = webhooksink.New(webhooksink.Options{Seed: r.cfg.Seed})
	mailerURL, err := r.serve(r.mailer)
	if err != nil {
		return err
	}
	apiPort, err := cluster.FreePort()
	if err != nil {
		return err
	}
	r.apiURL = fmt.Sprintf("http://127.0.0.1:%d", apiPort)
	r.env = []string{
		"ONCEFLOW_REDIS_URL=" + r.redis.URL, "ONCEFLOW_DATABASE_URL=" + r.pg.URL, "ONCEFLOW_PREFIX=agentchaos",
		"OPENAI_BASE_URL=" + modelURL + "/v1", "OPENAI_API_KEY=sk-chaos", "ORDERS_URL=" + ordersURL,
		"PAYMENTS_URL=" + paymentsURL, "MAILER_URL=" + mailerURL,
		"AGENT_API_KEYS=" + agentKey + "=acme", "AGENT_ADMIN_KEYS=" + agentAdmin + "=acme",
		fmt.Sprintf("REFUND_APPROVAL_ABOVE=%d", approvalAbove),
		"ONCEFLOW_CLAIM_IDLE=2s", "ONCEFLOW_RELAY_LEASE=2s", "ONCEFLOW_LEDGER_LEASE=2s", "ONCEFLOW_MAX_DELIVERIES=40",
	}
	role := func(name, role string, extra ...string) *cluster.Proc {
		return &cluster.Proc{Name: name, Bin: r.cfg.Bin, Env: append(append([]string{"AGENT_ROLE=" + role}, r.env...), extra...), LogDir: r.cfg.Dir}
	}
	r.api = role("agent-api", "api", fmt.Sprintf("ONCEFLOW_HTTP_ADDR=127.0.0.1:%d", apiPort))
	r.roles = []*cluster.Proc{r.api, role("agent-work-1", "work"), role("agent-work-2", "work"), role("agent-relay", "relay")}
	// The API first: it migrates the schema before the others start.
	if err := r.api.Start(); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, err := r.api.WaitLog(wctx, "agent listening"); err != nil {
		return err
	}
	for _, p := range r.roles[1:] {
		if err := p.Start(); err != nil {
			return err
		}
	}
	return nil
}

// customer sends support requests until ctx ends, each about an order of its own and
// retried with the same key and body until a final answer; one in five is sent twice
// at once.
func (r *agentRun) customer(ctx context.Context, id int, rng *rand.Rand) {
	for n := 0; ctx.Err() == nil; n++ {
		o := &supportOrder{order: fmt.Sprintf("O-%d-c%d-%04d", r.cfg.Seed, id, n), key: fmt.Sprintf("agentchaos-%d-c%d-%04d", r.cfg.Seed, id, n),
			email: fmt.Sprintf("c%d-%d@example.com", id, n), amount: 100 + rng.IntN(approvalAbove-100)}
		if rng.Float64() < r.cfg.ApprovalRate {
			o.amount = approvalAbove + 1 + rng.IntN(40000)
			o.approve = rng.Float64() >= r.cfg.RejectRate
		}
		r.mu.Lock()
		r.orders[o.order] = o
		r.mu.Unlock()
		body, _ := json.Marshal(map[string]string{"message": fmt.Sprintf("Please refund %d cents.", o.amount), "email": o.email})
		r.jobs.Add(1)
		if rng.IntN(5) == 0 {
			var two sync.WaitGroup
			two.Go(func() { r.submit(ctx, o, body) })
			two.Go(func() { r.submit(ctx, o, body) })
			two.Wait()
		} else {
			r.submit(ctx, o, body)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(2*int64(r.cfg.Think) + 1))):
		}
	}
}

// submit posts one support request until it gets a final answer (it keeps trying for a
// minute after ctx ends, so no request is left half-sent).
func (r *agentRun) submit(ctx context.Context, o *supportOrder, body []byte) {
	giveUp := time.Now().Add(r.cfg.Duration + time.Minute)
	for attempt := 0; time.Now().Before(giveUp); attempt++ {
		req, _ := http.NewRequest(http.MethodPost, r.apiURL+"/v1/orders/"+o.order+"/support", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+agentKey)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", o.key)
		r.requests.Add(1)
		resp, err := r.customerHTTP.Do(req)
		if err == nil {
			var out struct {
				JobID  string `json:"job_id"`
				Detail string `json:"detail"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&out)
			_ = resp.Body.Close()
			switch {
			case resp.StatusCode == http.StatusAccepted:
				r.mu.Lock()
				if o.jobID != "" && o.jobID != out.JobID {
					r.rejected = append(r.rejected, fmt.Sprintf("%s: job %s, then %s", o.key, o.jobID, out.JobID))
				}
				o.jobID = out.JobID
				r.accepted[out.JobID] = o
				r.mu.Unlock()
				return
			case resp.StatusCode < 500 && resp.StatusCode != http.StatusConflict:
				r.mu.Lock()
				r.rejected = append(r.rejected, fmt.Sprintf("%s: %d %s", o.key, resp.StatusCode, out.Detail))
				r.mu.Unlock()
				return
			}
		}
		select {
		case <-ctx.Done():
		default:
		}
		time.Sleep(time.Duration(min(1000, 50*(attempt+1))) * time.Millisecond)
	}
}

// pendingApproval is an entry of GET /v1/approvals.
type pendingApproval struct {
	JobID     string `json:"job_id"`
	Key       string `json:"key"`
	Tool      string `json:"tool"`
	Arguments string `json:"arguments"`
}

// operator lists the approvals and decides each until ctx ends: approve or reject as
// the order's seed says, retried until recorded; then, once in three, the same decision
// again (a retry: answered as the first) and, once in four, the opposite one (refused:
// 409).
func (r *agentRun) operator(ctx context.Context) {
	rng := rand.New(rand.NewPCG(r.cfg.Seed, 0x0be)) // #nosec G404 -- seeded operator behaviour
	owed := map[string]pendingApproval{}            // seen, not yet recorded
	for ctx.Err() == nil {
		var list struct{ Approvals []pendingApproval }
		if err := r.adminJSON(ctx, http.MethodGet, "/v1/approvals?limit=100", &list); err == nil {
			for _, a := range list.Approvals {
				r.mu.Lock()
				recorded := r.decided[a.Key]
				r.mu.Unlock()
				if !recorded {
					owed[a.Key] = a
				}
			}
		}
		for key, a := range owed {
			o := r.orderOf(a)
			if o == nil {
				r.decisionViolation("approval %s of job %s: arguments %s name no order the customers asked about", key, a.JobID, a.Arguments)
				delete(owed, key)
				continue
			}
			decision := map[bool]string{true: "approve", false: "reject"}
			// A retry after a lost answer is answered as the first: 200 either way.
			if code, _ := r.decide(ctx, a, decision[o.approve]); code != http.StatusOK {
				if code == http.StatusConflict {
					r.decisionViolation("job %s: the first decision %s refused with 409", a.JobID, decision[o.approve])
					delete(owed, key)
				}
				continue // no answer (a killed API, an outage): the same decision again later
			}
			delete(owed, key)
			r.mu.Lock()
			r.decided[key] = true
			r.mu.Unlock()
			if rng.IntN(3) == 0 {
				if code, replayed := r.decide(ctx, a, decision[o.approve]); code == http.StatusOK {
					if !replayed {
						r.decisionViolation("job %s: the same decision again was not answered as a replay", a.JobID)
					}
					r.retried.Add(1)
				}
			}
			if rng.IntN(4) == 0 {
				switch code, _ := r.decide(ctx, a, decision[!o.approve]); code {
				case http.StatusConflict:
					r.conflicting.Add(1)
				case http.StatusOK:
					r.decisionViolation("job %s: the opposite decision %s was accepted after %s", a.JobID, decision[!o.approve], decision[o.approve])
				}
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// orderOf returns the order an approval's refund is about.
func (r *agentRun) orderOf(a pendingApproval) *supportOrder {
	var args struct {
		Order string `json:"order"`
	}
	if json.Unmarshal([]byte(a.Arguments), &args) != nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.orders[args.Order]
}

func (r *agentRun) decisionViolation(format string, args ...any) {
	r.mu.Lock()
	r.decisionViolations = append(r.decisionViolations, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

// decide POSTs a decision and returns the status (0 for no answer) and whether it was
// answered as a replay.
func (r *agentRun) decide(ctx context.Context, a pendingApproval, decision string) (int, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.apiURL+"/v1/jobs/"+a.JobID+"/approvals/"+a.Key+"/"+decision,
		strings.NewReader(`{"by":"chaos-operator"}`))
	if err != nil {
		return 0, false
	}
	req.Header.Set("Authorization", "Bearer "+agentAdmin)
	req.Header.Set("Content-Type", "application/json")
	resp, err := r.operatorHTTP.Do(req)
	if err != nil {
		return 0, false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true"
}

// adminJSON sends an operator's request and decodes its 200 answer into v.
func (r *agentRun) adminJSON(ctx context.Context, method, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, method, r.apiURL+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+agentAdmin)
	resp, err := r.operatorHTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: %s", method, path, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// faults kills a role every KillMin..KillMax until ctx ends, restarting it after a short
// pause; Redis is killed once (at 35% of the run) and PostgreSQL restarted in immediate
// mode once (at 65%).
func (r *agentRun) faults(ctx context.Context) error {
	return faultLoop(ctx, r.rng, r.cfg.KillMin, r.cfg.KillMax, r.roles, r.event,
		&onceFault{at: r.start.Add(r.cfg.Duration * 35 / 100), do: func(pause time.Duration) error { return killRedis(r.event, r.redis, pause) }},
		&onceFault{at: r.start.Add(r.cfg.Duration * 65 / 100), do: func(pause time.Duration) error { return crashPostgres(r.event, r.pg, pause) }})
}

// drainAndCheck waits until every accepted job has its email (the operator still
// deciding), then checks the invariants.
func (r *agentRun) drainAndCheck(ctx context.Context) (*AgentReport, error) {
	db, err := pgx.Connect(ctx, r.pg.URL)
	if err != nil {
		return nil, err
	}
	defer db.Close(context.WithoutCancel(ctx))
	r.mu.Lock()
	want := len(r.accepted)
	r.mu.Unlock()
	deadline := time.Now().Add(r.cfg.DrainTimeout)
	for {
		var done int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM job_completions WHERE kind = 'agent.support'`).Scan(&done); err != nil {
			return nil, err
		}
		if done >= want && r.mailer.Stats().DistinctKeys >= want {
			break
		}
		if time.Now().After(deadline) {
			r.logf("drain timed out: %d of %d jobs done, %d emails", done, want, r.mailer.Stats().DistinctKeys)
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	r.operatorStop()
	<-r.operatorDone
	return r.check(ctx, db)
}

// check compares the effects with what the customers and the operator asked for.
func (r *agentRun) check(ctx context.Context, db *pgx.Conn) (*AgentReport, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rep := &AgentReport{Seed: r.cfg.Seed, Jobs: int(r.jobs.Load()), Accepted: len(r.accepted), Requests: r.requests.Load(),
		Retried: int(r.retried.Load()), Conflicting: int(r.conflicting.Load()), ModelRequests: r.model.Stats().Requests,
		OrderReads: r.reads.Load()}
	r.evMu.Lock()
	rep.Events = append([]string(nil), r.events...)
	r.evMu.Unlock()
	violate := func(format string, args ...any) {
		rep.Violations = append(rep.Violations, fmt.Sprintf(format, args...))
	}
	for _, v := range r.rejected {
		violate("a support request not accepted: %s", v)
	}
	rep.Violations = append(rep.Violations, r.decisionViolations...)

	// Every accepted job done once: a completion, a replies row, an email key.
	perJob := func(sql string) (map[string]int, error) {
		rows, err := db.Query(ctx, sql)
		if err != nil {
			return nil, err
		}
		m := map[string]int{}
		for rows.Next() {
			var id string
			var n int
			if err := rows.Scan(&id, &n); err != nil {
				return nil, err
			}
			m[id] = n
		}
		return m, rows.Err()
	}
	completions, err := perJob(`SELECT job_id, count(*) FROM job_completions WHERE kind = 'agent.support' GROUP BY job_id`)
	if err != nil {
		return nil, err
	}
	replies, err := perJob(`SELECT job_id, count(*) FROM replies GROUP BY job_id`)
	if err != nil {
		return nil, err
	}
	for _, n := range replies {
		rep.Replies += n
	}
	emails := map[string]int{}
	for _, d := range r.mailer.Deliveries() {
		emails[d.Key]++
	}
	mail := r.mailer.Stats()
	rep.Emails, rep.EmailPOSTs = mail.DistinctKeys, mail.Deliveries
	var notDone, noEmail []string
	for id := range r.accepted {
		if completions[id] != 1 {
			notDone = append(notDone, id)
		}
		if replies[id] != 1 {
			violate("job %s has %d replies rows, want 1", id, replies[id])
		}
		if emails["reply:"+id] == 0 {
			noEmail = append(noEmail, id)
		}
	}
	if len(notDone) > 0 {
		violate("%d accepted jobs not done: %s", len(notDone), clip(notDone))
	}
	if len(noEmail) > 0 {
		violate("%d accepted jobs without their email: %s", len(noEmail), clip(noEmail))
	}
	for key := range emails {
		if _, ok := r.accepted[strings.TrimPrefix(key, "reply:")]; !ok {
			violate("an email keyed %s, of no accepted job", key)
		}
	}
	if len(completions) != len(r.accepted) {
		violate("%d jobs done, %d accepted", len(completions), len(r.accepted))
	}

	// Every refund once: one payments key for a refunded order, none for a rejected one.
	refundKeys := map[string]map[string]bool{} // order -> keys
	for _, d := range r.payments.Deliveries() {
		var body struct {
			Order string `json:"order"`
		}
		if json.Unmarshal(d.Body, &body) != nil {
			violate("a refund POST whose body is not JSON: %s", d.Body)
			continue
		}
		if refundKeys[body.Order] == nil {
			refundKeys[body.Order] = map[string]bool{}
		}
		refundKeys[body.Order][d.Key] = true
	}
	pay := r.payments.Stats()
	rep.Refunds, rep.RefundPOSTs = pay.DistinctKeys, pay.Deliveries

	// Every approval decided once, as the operator decided: one decision record.
	type decision struct {
		n        int
		approved bool
	}
	decisions := map[string]decision{}
	rows, err := db.Query(ctx, `SELECT job_id, count(*), bool_and((convert_from(result, 'UTF8')::jsonb->>'approved')::boolean)
FROM job_steps WHERE name LIKE 'signal:approval:%' GROUP BY job_id`)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var id string
		var d decision
		var approved *bool
		if err := rows.Scan(&id, &d.n, &approved); err != nil {
			return nil, err
		}
		d.approved = approved != nil && *approved
		decisions[id] = d
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for id, o := range r.accepted {
		keys := len(refundKeys[o.order])
		d, asked := decisions[id]
		switch {
		case o.amount <= approvalAbove:
			if asked {
				violate("job %s (refund of %d, under the threshold) has a decision", id, o.amount)
			}
			if keys != 1 {
				violate("order %s (refund of %d): %d refund keys, want 1", o.order, o.amount, keys)
			}
		default:
			rep.Approvals++
			if !asked || d.n != 1 {
				violate("job %s (refund of %d, above the threshold): %d decisions, want 1", id, o.amount, d.n)
				continue
			}
			if d.approved != o.approve {
				violate("job %s: decided approved=%v, the operator decided %v", id, d.approved, o.approve)
			}
			want := 0
			if d.approved {
				rep.Approved++
				want = 1
			} else {
				rep.Rejected++
			}
			if keys != want {
				violate("order %s (refund of %d, approved=%v): %d refund keys, want %d", o.order, o.amount, d.approved, keys, want)
			}
		}
	}
	for order := range refundKeys {
		if o, ok := r.orders[order]; !ok || o.jobID == "" {
			violate("a refund of order %s, of no accepted request", order)
		}
	}

	if err := db.QueryRow(ctx, `SELECT count(*) FROM llm_calls WHERE attempt > 1`).Scan(&rep.TakenOver); err != nil {
		return nil, err
	}

	// Nothing dead-lettered.
	rdb := redis.NewClient(&redis.Options{Addr: strings.TrimSuffix(strings.TrimPrefix(r.redis.URL, "redis://"), "/0")})
	defer rdb.Close()
	for start := "-"; start != ""; {
		page, next, err := queue.ListDead(ctx, rdb, queue.Keys{Prefix: "agentchaos", Queue: "agent"}, start, 1000)
		if err != nil {
			return nil, err
		}
		for _, d := range page {
			violate("dead-lettered: job %s: %s", d.JobID, d.Reason)
		}
		start = next
	}
	return rep, nil
}

// stopAll stops every process and server, the stores last.
func (r *agentRun) stopAll() {
	for _, p := range r.roles {
		p.Stop(10 * time.Second)
	}
	for _, s := range r.servers {
		_ = s.Close()
	}
	if r.model != nil {
		r.model.Close()
	}
	if r.pg != nil {
		r.pg.Down()
	}
	if r.redis != nil {
		r.redis.Down()
	}
}
