package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/internal/testenv"
)

// agentProgram is a program hosting the AgentApp's queue (its workflow's workers run in
// the test's own process, as `onceflow work` would run them elsewhere).
var agentProgram = cli.App{Name: "agentd", Workflows: func(cli.Host) ([]onceflow.Workflow, error) {
	return []onceflow.Workflow{{Name: "tickets", Queues: map[string]onceflow.QueueConfig{onceflow.DefaultQueue: {}}}}, nil
}}

// agentEnv is the environment of a command of app's deployment, run by the user tester.
func agentEnv(t *testing.T, app *adminuitest.AgentApp) func(string) string {
	t.Helper()
	vars := map[string]string{
		"ONCEFLOW_REDIS_URL":    testenv.RedisURL(t),
		"ONCEFLOW_DATABASE_URL": app.DatabaseURL,
		"ONCEFLOW_PREFIX":       app.Prefix,
		"ONCEFLOW_LOG_FORMAT":   "text",
		"USER":                  "tester",
	}
	return func(k string) string { return vars[k] }
}

// runCommand runs prog's command args to its end.
func runCommand(t *testing.T, prog cli.App, getenv func(string) string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errs bytes.Buffer
	err := cli.Run(context.Background(), prog, args, &out, &errs, getenv)
	return out.String(), errs.String(), cli.ExitCode(err)
}

// decision returns the decision recorded on the call of a.
func decision(t *testing.T, app *adminuitest.AgentApp, a onceflow.Approval) onceflow.Decision {
	t.Helper()
	var raw []byte
	if err := app.DB.QueryRow(context.Background(), `SELECT result FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3`,
		a.Tenant, a.JobID, "signal:approval:"+a.Key).Scan(&raw); err != nil {
		t.Fatalf("the decision on %s: %v", a.Key, err)
	}
	var d onceflow.Decision
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	return d
}

// `approvals list` shows every tenant's pending calls (or one tenant's), `approve` lets
// one run once (its tenant found from the call) and `reject` keeps one from running
// (in a program without workflows, on the queue --queue names); each wakes its job, and
// a decided call cannot be decided again (exit 1).
func TestApprovalsListApproveAndReject(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-1042")
	app.Run(t)
	acme := app.Ask(t, "acme", "Refund A-1042, please.")
	globex := app.Ask(t, "globex", "Refund A-1042 for Globex.")
	getenv := agentEnv(t, app)

	out, errOut, code := runCommand(t, agentProgram, getenv, "approvals", "list", "--json")
	var listed []onceflow.Approval
	if code != 0 || json.Unmarshal([]byte(out), &listed) != nil || len(listed) != 2 {
		t.Fatalf("approvals list --json: exit %d, %q %s", code, out, errOut)
	}
	for _, a := range listed {
		if a.Tool != "issue_refund" || !strings.Contains(a.Arguments, "A-1042") || len(a.Messages) != 5 || a.Deadline.IsZero() {
			t.Errorf("listed %+v", a)
		}
	}
	out, _, code = runCommand(t, agentProgram, getenv, "approvals", "list", "--tenant", "acme")
	if code != 0 || !strings.HasPrefix(out, "TENANT") || !strings.Contains(out, acme.JobID) || !strings.Contains(out, acme.Key) || strings.Contains(out, globex.JobID) {
		t.Fatalf("approvals list --tenant acme: exit %d\n%s", code, out)
	}
	if out, _, _ := runCommand(t, agentProgram, getenv, "approvals", "list", "--tenant", "initech"); !strings.Contains(out, "no tool call waits for a decision") {
		t.Fatalf("approvals list of a tenant without calls: %q", out)
	}

	// Approve acme's, its tenant found from the pending call; flags after the arguments.
	out, errOut, code = runCommand(t, agentProgram, getenv, "approvals", "approve", acme.JobID, acme.Key, "--note", "customer called")
	if code != 0 || !strings.Contains(out, "approved call "+acme.Key+" of job "+acme.JobID+" (tenant acme) as cli:tester") {
		t.Fatalf("approvals approve: exit %d, %q %s", code, out, errOut)
	}
	app.WaitStatus(t, "acme", acme.JobID, onceflow.StatusDone)
	if n := app.Refunds(acme.Key); n != 1 {
		t.Fatalf("the approved refund ran %d times, want 1", n)
	}
	if d := decision(t, app, acme); !d.Approved || d.By != "cli:tester" || d.Note != "customer called" {
		t.Fatalf("acme's decision %+v", d)
	}
	// Reject globex's from a program without workflows, on the queue --queue names.
	out, errOut, code = runCommand(t, cli.App{}, getenv, "approvals", "reject", "--tenant", "globex", "--by", "ops@example.com",
		"--note", "a duplicate", "--queue", onceflow.DefaultQueue, globex.JobID, globex.Key)
	if code != 0 || !strings.Contains(out, "rejected call "+globex.Key) {
		t.Fatalf("approvals reject: exit %d, %q %s", code, out, errOut)
	}
	app.WaitStatus(t, "globex", globex.JobID, onceflow.StatusDone)
	if n := app.Refunds(globex.Key); n != 0 {
		t.Fatalf("the rejected refund ran %d times", n)
	}
	if d := decision(t, app, globex); d.Approved || d.By != "ops@example.com" || d.Note != "a duplicate" {
		t.Fatalf("globex's decision %+v", d)
	}
	// Decided calls: exit 1, nothing changes.
	for _, args := range [][]string{
		{"approvals", "approve", globex.JobID, globex.Key},
		{"approvals", "approve", "--tenant", "globex", globex.JobID, globex.Key},
		{"approvals", "reject", "--tenant", "acme", acme.JobID, acme.Key},
	} {
		if _, errOut, code := runCommand(t, agentProgram, getenv, args...); code != 1 || !strings.Contains(errOut, "waits for a decision") {
			t.Errorf("%v: exit %d, want 1; %s", args, code, errOut)
		}
	}
	if n := app.Refunds(globex.Key); n != 0 {
		t.Fatalf("approving a rejected call ran it: %d", n)
	}
	if out, _, code := runCommand(t, agentProgram, getenv, "approvals", "list"); code != 0 || !strings.Contains(out, "no tool call waits for a decision") {
		t.Fatalf("approvals list after the decisions: exit %d %q", code, out)
	}
}

// Mistakes in the command line exit 2 before anything is decided, and a call another
// tenant names is not decided (exit 1).
func TestApprovalsUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-7")
	app.Run(t)
	a := app.Ask(t, "acme", "Refund A-7.")
	getenv := agentEnv(t, app)
	for _, args := range [][]string{
		{"approvals"}, {"approvals", "frob"}, {"approvals", "approve"}, {"approvals", "approve", a.JobID},
		{"approvals", "approve", a.JobID, "not-a-key"}, {"approvals", "approve", "a job", a.Key}, {"approvals", "approve", a.JobID, a.Key, "extra"},
		{"approvals", "approve", a.JobID, a.Key, "--note", strings.Repeat("n", onceflow.MaxDecisionNote+1)},
		{"approvals", "reject", a.JobID, a.Key, "--by", "a\nb"}, {"approvals", "reject", a.JobID, a.Key, "--tenant", "a/b"},
		{"approvals", "list", "--tenant", "acme", "--all"}, {"approvals", "list", "--limit", "0"}, {"approvals", "list", "x"},
		{"approvals", "approve", a.JobID, a.Key, "--queue", "bad queue"},
	} {
		if _, errOut, code := runCommand(t, agentProgram, getenv, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2; %s", args, code, errOut)
		}
	}
	if _, errOut, code := runCommand(t, cli.App{}, getenv, "approvals", "approve", a.JobID, a.Key); code != 2 || !strings.Contains(errOut, "--queue") {
		t.Errorf("approve in a program without queues and no --queue: exit %d, want 2 naming --queue; %s", code, errOut)
	}
	if _, errOut, code := runCommand(t, agentProgram, getenv, "approvals", "approve", "--tenant", "globex", a.JobID, a.Key); code != 1 {
		t.Errorf("approve naming another tenant: exit %d, want 1; %s", code, errOut)
	}
	if _, errOut, code := runCommand(t, agentProgram, getenv, "approvals", "-h"); code != 0 || !strings.Contains(errOut, "usage: agentd approvals list") {
		t.Errorf("approvals -h: exit %d; %s", code, errOut)
	}
	if _, errOut, code := runCommand(t, agentProgram, getenv, "approvals", "approve", "-h"); code != 0 || !strings.Contains(errOut, "-note") || !strings.Contains(errOut, "-queue") {
		t.Errorf("approvals approve -h: exit %d; %s", code, errOut)
	}
	if list, _ := app.Client.Inspector().Approvals(context.Background(), "", true, 10); len(list) != 1 || app.Refunds(a.Key) != 0 {
		t.Fatalf("the refused commands decided: %d pending, %d refunds", len(list), app.Refunds(a.Key))
	}
}
