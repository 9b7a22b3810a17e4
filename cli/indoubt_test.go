package cli_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui/adminuitest"
)

// `indoubt list` shows the jobs in doubt with their calls; `indoubt resolve --happened`
// records the operator's result and the job goes on without calling the tool again;
// `--not-happened` puts the job back and it calls the tool again, once; a resolved
// call is not in doubt any more (exit 1).
func TestInDoubtListAndResolve(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-9")
	app.Run(t)
	happened, hc := app.InDoubt(t, "acme", "Refund A-9.")
	again, ac := app.InDoubt(t, "globex", "Refund A-9 for Globex.")
	getenv := agentEnv(t, app)

	out, errOut, code := runCommand(t, agentProgram, getenv, "indoubt", "list", "--json")
	var jobs []onceflow.InDoubtJob
	if code != 0 || json.Unmarshal([]byte(out), &jobs) != nil || len(jobs) != 2 {
		t.Fatalf("indoubt list --json: exit %d, %q %s", code, out, errOut)
	}
	for _, j := range jobs {
		if len(j.Calls) != 1 || j.Calls[0].Tool != "issue_refund" || !strings.Contains(j.Calls[0].Arguments, "A-9") || j.Calls[0].StartedAt.IsZero() {
			t.Errorf("listed %+v", j)
		}
	}
	out, _, code = runCommand(t, agentProgram, getenv, "indoubt", "list")
	if code != 0 || !strings.HasPrefix(out, "TENANT") || !strings.Contains(out, happened) || !strings.Contains(out, ac.Key) {
		t.Fatalf("indoubt list: exit %d\n%s", code, out)
	}

	// It happened (the tenant found from the job in doubt): no second refund.
	out, errOut, code = runCommand(t, agentProgram, getenv, "indoubt", "resolve", happened, hc.Key, "--happened", "--result", `{"refund":"re_9"}`)
	if code != 0 || !strings.Contains(out, "resolved call "+hc.Key+" of job "+happened+" (tenant acme): it happened") {
		t.Fatalf("indoubt resolve --happened: exit %d, %q %s", code, out, errOut)
	}
	app.WaitStatus(t, "acme", happened, onceflow.StatusDone)
	if n := app.Refunds(hc.Key); n != 1 {
		t.Fatalf("the refund ran %d times, want 1", n)
	}
	// It did not happen: the job calls the tool again.
	out, errOut, code = runCommand(t, agentProgram, getenv, "indoubt", "resolve", "--tenant", "globex", "--not-happened", again, ac.Key)
	if code != 0 || !strings.Contains(out, "it did not happen") {
		t.Fatalf("indoubt resolve --not-happened: exit %d, %q %s", code, out, errOut)
	}
	app.WaitStatus(t, "globex", again, onceflow.StatusDone)
	if n := app.Refunds(ac.Key); n != 2 {
		t.Fatalf("the refund ran %d times, want 2", n)
	}
	for _, args := range [][]string{
		{"indoubt", "resolve", again, ac.Key, "--not-happened"},
		{"indoubt", "resolve", "--tenant", "globex", again, ac.Key, "--not-happened"},
	} {
		if _, errOut, code := runCommand(t, agentProgram, getenv, args...); code != 1 || !strings.Contains(errOut, "not in doubt") {
			t.Errorf("%v: exit %d, want 1; %s", args, code, errOut)
		}
	}
	if n := app.Refunds(ac.Key); n != 2 {
		t.Fatalf("a second resolution ran the refund again: %d", n)
	}
	if out, _, _ := runCommand(t, agentProgram, getenv, "indoubt", "list"); !strings.Contains(out, "no job in doubt") {
		t.Fatalf("indoubt list after the resolutions: %q", out)
	}
}

// Mistakes in the command line exit 2 and resolve nothing; another tenant's name
// resolves nothing (exit 1).
func TestInDoubtUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	app := adminuitest.NewAgentApp(t, "A-10")
	app.Run(t)
	id, call := app.InDoubt(t, "acme", "Refund A-10.")
	getenv := agentEnv(t, app)
	for _, args := range [][]string{
		{"indoubt"}, {"indoubt", "frob"}, {"indoubt", "resolve", id, call.Key}, {"indoubt", "resolve", id, call.Key, "--happened"},
		{"indoubt", "resolve", id, call.Key, "--happened", "--result", "  "}, {"indoubt", "resolve", id, call.Key, "--happened", "--not-happened", "--result", "x"},
		{"indoubt", "resolve", id, call.Key, "--not-happened", "--result", "x"}, {"indoubt", "resolve", id, "--not-happened"},
		{"indoubt", "resolve", id, "key-1", "--not-happened"}, {"indoubt", "resolve", id, call.Key, "--not-happened", "--tenant", "a b"},
		{"indoubt", "list", "--limit", "0"}, {"indoubt", "list", "x"},
	} {
		if _, errOut, code := runCommand(t, agentProgram, getenv, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2; %s", args, code, errOut)
		}
	}
	if _, errOut, code := runCommand(t, agentProgram, getenv, "indoubt", "resolve", "--tenant", "globex", id, call.Key, "--not-happened"); code != 1 || !strings.Contains(errOut, "not in doubt") {
		t.Errorf("resolve naming another tenant: exit %d, want 1; %s", code, errOut)
	}
	if _, errOut, code := runCommand(t, agentProgram, getenv, "indoubt", "-h"); code != 0 || !strings.Contains(errOut, "usage: agentd indoubt list") {
		t.Errorf("indoubt -h: exit %d; %s", code, errOut)
	}
	st, err := app.Client.JobState(t.Context(), "acme", id)
	if err != nil || st.Status != onceflow.StatusInDoubt || app.Refunds(call.Key) != 1 {
		t.Fatalf("the refused commands changed the job: %v %v, %d refunds", st, err, app.Refunds(call.Key))
	}
}
