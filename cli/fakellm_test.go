package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// startFakeLLM runs `onceflow fake-llm` on a free port and returns it and its /v1 URL.
func startFakeLLM(t *testing.T, args ...string) (*testenv.Process, string) {
	t.Helper()
	p := testenv.Start(t, testenv.Binary(t), nil, append([]string{"fake-llm", "--addr", "127.0.0.1:0"}, args...)...)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	line := p.WaitLog(ctx, "fake-llm listening")
	return p, fmt.Sprint(line["base_url"])
}

const chatRequest = `{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"Summarise:\n\nhello world"}]}`

func TestFakeLLMCommandFaultsAndStats(t *testing.T) {
	t.Parallel()
	p, base := startFakeLLM(t, "--fail-429", "1", "--retry-after", "3", "--seed", "5")
	req, _ := http.NewRequest(http.MethodPost, base+"/chat/completions", strings.NewReader(chatRequest))
	req.Header.Set("Idempotency-Key", "k-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	eb, ok := llm.ParseErrorBody(body)
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "3" || !ok || eb.Code != "rate_limit_exceeded" {
		t.Fatalf("%d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	st, err := fakeserver.FetchStats(context.Background(), nil, base)
	if err != nil {
		t.Fatal(err)
	}
	if st.Requests != 1 || st.ByStatus["429"] != 1 || st.ByIdempotencyKey["k-1"] != 1 {
		t.Fatalf("stats %+v", st)
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
}

func TestFakeLLMCommandShutsDownWhileARequestHangs(t *testing.T) {
	t.Parallel()
	p, base := startFakeLLM(t, "--hang", "1")
	errc := make(chan error, 1)
	go func() {
		resp, err := http.Post(base+"/chat/completions", "application/json", strings.NewReader(chatRequest))
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for { // wait until the request is in flight
		st, err := fakeserver.FetchStats(context.Background(), nil, base)
		if err == nil && st.InFlight == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("request never arrived: %+v %v", st, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	p.Signal(syscall.SIGTERM)
	if code := p.Wait(10 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM with a hung request", code)
	}
	if err := <-errc; err == nil {
		t.Fatal("the hung request got an answer")
	}
}

func TestFakeLLMCommandRejectsBadFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"--hang", "2"}, {"--tool-call-ids", "sometimes"}, {"--retry-after", "-1"}, {"--fail-429", "x"},
		{"--tool-args", `{"a":1}`}, {"--tool", "x", "--tool-args", "[1]"}, {"--tool", "x", "--no-tool-calls"},
		{"--rpm", "-1"}, {"--tpm", "-5"}, {"--rpm", "x"}, {"--drip-interval", "0"}, {"--batch-delay", "0"}, {"--batch-window", "-1s"},
		{"--batch-fail-every", "-1"}, {"--batch-expire-every", "-2"}, {"--batch-retention", "0"}, {"--batch-max-bytes", "0"}} {
		p := testenv.Start(t, testenv.Binary(t), nil, append([]string{"fake-llm", "--addr", "127.0.0.1:0"}, args...)...)
		if code := p.Wait(10 * time.Second); code != 2 {
			t.Errorf("%v: exit %d, want 2; stderr:\n%s", args, code, p.Stderr())
		}
	}
}

// --batch-delay ends a message batch that long after its creation; with
// --batch-fail-every 1 every request errors, and /stats counts the submissions.
func TestFakeLLMCommandServesBatches(t *testing.T) {
	t.Parallel()
	_, base := startFakeLLM(t, "--batch-delay", "300ms", "--batch-fail-every", "1")
	body := `{"requests":[{"custom_id":"job-1","params":{"model":"claude-haiku-4-5","max_tokens":64,"messages":[{"role":"user","content":"hello"}]}}]}`
	resp, err := http.Post(base+"/messages/batches", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var b struct {
		ID               string `json:"id"`
		ProcessingStatus string `json:"processing_status"`
	}
	err = json.NewDecoder(resp.Body).Decode(&b)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || b.ProcessingStatus != "in_progress" {
		t.Fatalf("create: %d %+v %v", resp.StatusCode, b, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.ProcessingStatus != "ended" {
		if time.Now().After(deadline) {
			t.Fatalf("batch never ended: %+v", b)
		}
		time.Sleep(50 * time.Millisecond)
		resp, err := http.Get(base + "/messages/batches/" + b.ID)
		if err != nil {
			t.Fatal(err)
		}
		_ = json.NewDecoder(resp.Body).Decode(&b)
		resp.Body.Close()
	}
	resp, err = http.Get(base + "/messages/batches/" + b.ID + "/results")
	if err != nil {
		t.Fatal(err)
	}
	results, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(results), `"custom_id":"job-1","result":{"type":"errored"`) {
		t.Errorf("results: %s", results)
	}
	st, err := fakeserver.FetchStats(context.Background(), nil, base)
	if err != nil || st.BatchByCustomID["job-1"] != 1 || st.BatchItems["errored"] != 1 || len(st.BatchBilledByCustomID) != 0 {
		t.Errorf("stats %+v %v", st, err)
	}
}

// --tool and --tool-args make the answer a call to that tool with those arguments;
// --no-tool-calls makes it text although the request declares tools.
func TestFakeLLMCommandCallsTheToolItIsTold(t *testing.T) {
	t.Parallel()
	const tools = `,"tools":[{"type":"function","function":{"name":"lookup_order"}},{"type":"function","function":{"name":"issue_refund"}}]}`
	body := strings.TrimSuffix(chatRequest, "}") + tools
	for _, tc := range []struct {
		args     []string
		wantTool string
		wantArgs string
	}{
		{[]string{"--tool", "issue_refund", "--tool-args", `{"order_id": "A-17", "amount_cents": 1299}`}, "issue_refund", `{"order_id":"A-17","amount_cents":1299}`},
		{[]string{"--no-tool-calls"}, "", ""},
		{nil, "lookup_order", "{}"},
	} {
		_, base := startFakeLLM(t, tc.args...)
		resp, err := http.Post(base+"/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got, err := openai.DecodeCompletion(b)
		if err != nil {
			t.Fatalf("%v: %v: %s", tc.args, err, b)
		}
		switch {
		case tc.wantTool == "" && (len(got.ToolCalls) != 0 || got.Content == ""):
			t.Fatalf("%v: %s, want a text answer", tc.args, b)
		case tc.wantTool != "" && (len(got.ToolCalls) != 1 || got.ToolCalls[0].Name != tc.wantTool || got.ToolCalls[0].Arguments != tc.wantArgs):
			t.Fatalf("%v: %s, want %s(%s)", tc.args, b, tc.wantTool, tc.wantArgs)
		}
	}
}

// --rpm and --tpm enforce the limits: the headers on every answer, then a 429 with
// Retry-After and rate_limit_exceeded, counted in /stats as rate_limited.
func TestFakeLLMCommandEnforcesRateLimits(t *testing.T) {
	t.Parallel()
	_, base := startFakeLLM(t, "--rpm", "2", "--tpm", "100000")
	var last *http.Response
	for i := range 3 {
		resp, err := http.Post(base+"/chat/completions", "application/json", strings.NewReader(chatRequest))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		rl, ok := llm.ParseRateLimit(resp.Header, time.Now())
		if !ok || rl.Requests.Limit != 2 || rl.Tokens.Limit != 100000 || !rl.Requests.HasRemaining || !rl.Tokens.HasReset {
			t.Fatalf("request %d: rate limits %+v in %v", i, rl, resp.Header)
		}
		if i == 2 {
			eb, _ := llm.ParseErrorBody(body)
			if resp.StatusCode != 429 || eb.Code != "rate_limit_exceeded" || eb.Type != "requests" || resp.Header.Get("Retry-After") == "" {
				t.Fatalf("third request: %d %v %s", resp.StatusCode, resp.Header, body)
			}
		} else if resp.StatusCode != 200 || rl.Requests.Remaining != int64(1-i) {
			t.Fatalf("request %d: %d, %d requests left: %s", i, resp.StatusCode, rl.Requests.Remaining, body)
		}
		last = resp
	}
	if ra := last.Header.Get("Retry-After"); ra != "30" && ra != "29" {
		t.Fatalf("Retry-After %q, want about 30 (2 a minute)", ra)
	}
	st, err := fakeserver.FetchStats(context.Background(), nil, base)
	if err != nil {
		t.Fatal(err)
	}
	if st.RateLimited != 1 || st.ByStatus["429"] != 1 || st.ByStatus["200"] != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// writeScript writes a --script file into the test's temporary directory.
func writeScript(t *testing.T, content string) string {
	t.Helper()
	name := filepath.Join(t.TempDir(), "script.json")
	if err := os.WriteFile(name, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return name
}

// --script answers each request with the turn its count of tool results selects, plain
// and streamed, the last turn once the script runs out; --tool-call-ids stable repeats
// the calls' ids for a repeated request, random makes new ones; the start line names
// the file and its turns.
func TestFakeLLMCommandAnswersFromScript(t *testing.T) {
	t.Parallel()
	script := writeScript(t, `[
		{"tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-17"}}, {"name": "issue_refund", "arguments": {"amount_cents": 1299}}]},
		{"text": "one result in"},
		{"text": "Refunded order A-17."}
	]`)
	for _, ids := range []string{fakeserver.ToolCallIDsStable, fakeserver.ToolCallIDsRandom} {
		t.Run(ids, func(t *testing.T) {
			t.Parallel()
			p := testenv.Start(t, testenv.Binary(t), nil, "fake-llm", "--addr", "127.0.0.1:0", "--script", script, "--tool-call-ids", ids)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			line := p.WaitLog(ctx, "fake-llm listening")
			if line["script"] != script || line["script_turns"] != 3.0 {
				t.Fatalf("start line %v, want the script and its 3 turns", line)
			}
			c := openai.New(openai.Config{BaseURL: fmt.Sprint(line["base_url"]), APIKey: "k"})
			req := &llm.Request{Messages: []llm.Message{{Role: llm.RoleUser, Content: "Order A-17 arrived broken."}},
				Tools: []llm.Tool{{Name: "lookup_order"}, {Name: "issue_refund"}}}
			var answers []*llm.Response
			for _, stream := range []bool{false, true} {
				var resp *llm.Response
				var err error
				if stream {
					resp, err = llm.Collect(c.Stream(ctx, req))
				} else {
					resp, err = c.Complete(ctx, req)
				}
				if err != nil {
					t.Fatalf("stream=%v: %v", stream, err)
				}
				got := resp.ToolCalls
				if resp.FinishReason != llm.FinishToolCalls || len(got) != 2 || got[0].Name != "lookup_order" || got[0].Arguments != `{"order_id":"A-17"}` ||
					got[1].Name != "issue_refund" || got[1].Arguments != `{"amount_cents":1299}` || got[0].ID == got[1].ID {
					t.Fatalf("stream=%v: %+v, want the first turn's two calls", stream, resp)
				}
				answers = append(answers, resp)
			}
			if same := answers[0].ToolCalls[0].ID == answers[1].ToolCalls[0].ID; same != (ids == fakeserver.ToolCallIDsStable) {
				t.Fatalf("ids %s then %s for the same request", answers[0].ToolCalls[0].ID, answers[1].ToolCalls[0].ID)
			}

			calls := answers[0].ToolCalls
			req.Messages = append(req.Messages, llm.Message{Role: llm.RoleAssistant, ToolCalls: calls},
				llm.Message{Role: llm.RoleTool, ToolCallID: calls[0].ID, Content: `{"status":"delivered"}`})
			if resp, err := c.Complete(ctx, req); err != nil || resp.Content != "one result in" || resp.FinishReason != llm.FinishStop {
				t.Fatalf("one tool result: %+v, %v", resp, err)
			}
			for range 2 { // two results, then three: the last turn
				req.Messages = append(req.Messages, llm.Message{Role: llm.RoleTool, ToolCallID: calls[1].ID, Content: `{"refunded":true}`})
				if resp, err := llm.Collect(c.Stream(ctx, req)); err != nil || resp.Content != "Refunded order A-17." || resp.FinishReason != llm.FinishStop {
					t.Fatalf("%d tool results: %+v, %v", len(req.Messages)-2, resp, err)
				}
			}
			if st, err := fakeserver.FetchStats(ctx, nil, fmt.Sprint(line["base_url"])); err != nil || st.Requests != 5 || st.ByStatus["200"] != 5 {
				t.Fatalf("stats %+v, %v", st, err)
			}
		})
	}
}

// A script that cannot be read or is invalid, or --script beside a tool flag, stops
// the command with exit 2 and a line naming the problem: the file, the turn, the field.
func TestFakeLLMCommandRejectsBadScripts(t *testing.T) {
	t.Parallel()
	good := writeScript(t, `[{"text": "hi"}]`)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--script", filepath.Join(t.TempDir(), "missing.json")}, "missing.json: no such file"},
		{[]string{"--script", writeScript(t, `[{"text": "hi"}, {"tool_calls": [{"name": "a", "arguments": [1]}]}]`)}, "invalid script: turn 1: tool_calls[0].arguments: not a JSON object"},
		{[]string{"--script", writeScript(t, `[{"text": "hi", "tool_calls": [{"name": "a"}]}]`)}, "invalid script: turn 0: has both tool_calls and text"},
		{[]string{"--script", writeScript(t, `[{"text": "hi"}, {"tool_calls": [{"name": "a", "id": "x"}]}]`)}, "invalid script: turn 1: tool_calls[0].id: unknown field"},
		{[]string{"--script", writeScript(t, `[]`)}, "invalid script: no turns"},
		{[]string{"--script", good, "--tool", "lookup_order"}, "--script excludes --tool"},
		{[]string{"--script", good, "--no-tool-calls"}, "--script excludes --tool"},
	} {
		p := testenv.Start(t, testenv.Binary(t), nil, append([]string{"fake-llm", "--addr", "127.0.0.1:0"}, c.args...)...)
		if code := p.Wait(10 * time.Second); code != 2 || !strings.Contains(p.Stderr(), c.want) {
			t.Errorf("%v: exit %d, want 2 with %q; stderr:\n%s", c.args, code, c.want, p.Stderr())
		}
	}
}
