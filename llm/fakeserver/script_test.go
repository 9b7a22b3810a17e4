package fakeserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/openai/openai-go/v3/packages/param"
	"github.com/openai/openai-go/v3/responses"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
)

// agentScript is an agent's conversation as a script file: two calls at once, a call
// without arguments, then two text turns.
const agentScript = `[
  {"tool_calls": [
    {"name": "lookup_order", "arguments": {"order_id": "A-17"}},
    {"name": "check_stock", "arguments": {"sku": "KETTLE-2", "warehouses": ["ZRH", "BER"]}}
  ]},
  {"tool_calls": [{"name": "issue_refund"}]},
  {"text": "Refunded order A-17: 12.99 EUR."},
  {"text": "Anything else?"}
]`

// scripted is agentScript parsed, or the test fails.
func scripted(t *testing.T) []fakeserver.ScriptTurn {
	t.Helper()
	turns, err := fakeserver.ParseScript([]byte(agentScript))
	if err != nil {
		t.Fatal(err)
	}
	return turns
}

// scriptedCall is a tool call a turn of agentScript makes: its name and arguments.
type scriptedCall struct{ name, args string }

// wantTurn is what answers a conversation holding i tool results (agentScript's turn
// i, the last once i is past the end): its calls, or its text.
func wantTurn(i int) ([]scriptedCall, string) {
	switch i {
	case 0:
		return []scriptedCall{{"lookup_order", `{"order_id":"A-17"}`}, {"check_stock", `{"sku":"KETTLE-2","warehouses":["ZRH","BER"]}`}}, ""
	case 1:
		return []scriptedCall{{"issue_refund", `{}`}}, ""
	case 2:
		return nil, "Refunded order A-17: 12.99 EUR."
	}
	return nil, "Anything else?"
}

// conversation is an agent's request whose conversation holds n tool results, after
// an assistant message making the n calls they answer.
func conversation(n int) *llm.Request {
	req := agentRequest()
	if n == 0 {
		return req
	}
	calls := make([]llm.ToolCall, n)
	for i := range calls {
		calls[i] = llm.ToolCall{ID: fmt.Sprintf("call_prev_%d", i), Name: "lookup_order", Arguments: `{"order_id":"A-17"}`}
	}
	req.Messages = append(req.Messages, llm.Message{Role: llm.RoleAssistant, ToolCalls: calls})
	for _, c := range calls {
		req.Messages = append(req.Messages, llm.Message{Role: llm.RoleTool, ToolCallID: c.ID, Content: `{"status":"delivered"}`})
	}
	return req
}

func TestParseScriptReadsTurnsAndRefusesABadFile(t *testing.T) {
	t.Parallel()
	t.Run("reads tool-call and text turns, arguments compacted and absent ones {}", func(t *testing.T) {
		t.Parallel()
		got := scripted(t)
		want := []fakeserver.ScriptTurn{
			{ToolCalls: []fakeserver.ScriptCall{
				{Name: "lookup_order", Arguments: json.RawMessage(`{"order_id":"A-17"}`)},
				{Name: "check_stock", Arguments: json.RawMessage(`{"sku":"KETTLE-2","warehouses":["ZRH","BER"]}`)}}},
			{ToolCalls: []fakeserver.ScriptCall{{Name: "issue_refund", Arguments: json.RawMessage(`{}`)}}},
			{Text: "Refunded order A-17: 12.99 EUR."},
			{Text: "Anything else?"},
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("got %+v\nwant %+v", got, want)
		}
	})
	t.Run("an empty text is a text turn", func(t *testing.T) {
		t.Parallel()
		got, err := fakeserver.ParseScript([]byte(`[{"text": ""}]`))
		if err != nil || len(got) != 1 || got[0].Text != "" || got[0].ToolCalls != nil {
			t.Fatalf("%+v, %v", got, err)
		}
	})
	t.Run("refuses a bad file naming the turn and the field", func(t *testing.T) {
		t.Parallel()
		for _, c := range []struct{ file, want string }{
			{``, "invalid script: empty"},
			{`[]`, "invalid script: no turns"},
			{`{"text": "hi"}`, "invalid script: must be an array of turns"},
			{`[{"text": "hi"}] [{"text": "again"}]`, "invalid script: unexpected data after the JSON value"},
			{`[{"text": "hi"}, {"txt": "typo"}]`, "invalid script: turn 1: txt: unknown field"},
			{`[{"tool_calls": [{"name": "a", "id": "call_1"}]}]`, "invalid script: turn 0: tool_calls[0].id: unknown field"},
			{`[{"tool_calls": [{"name": "a"}], "text": "and words"}]`, "invalid script: turn 0: has both tool_calls and text"},
			{`[{"text": "hi"}, {}]`, "invalid script: turn 1: has neither tool_calls nor text"},
			{`[{"text": null}]`, "invalid script: turn 0: has neither tool_calls nor text"},
			{`[{"tool_calls": []}]`, "invalid script: turn 0: tool_calls is empty"},
			{`[{"text": "a"}, {"text": "b"}, {"tool_calls": [{"name": "a"}, {"name": "b", "arguments": [1, 2]}]}]`, "invalid script: turn 2: tool_calls[1].arguments: not a JSON object"},
			{`[{"tool_calls": [{"name": "a", "arguments": "{\"x\": 1}"}]}]`, "invalid script: turn 0: tool_calls[0].arguments: not a JSON object"},
			{`[{"tool_calls": [{"name": "a", "arguments": null}]}]`, "invalid script: turn 0: tool_calls[0].arguments: not a JSON object"},
			{`[{"tool_calls": [{"arguments": {}}]}]`, "invalid script: turn 0: tool_calls[0].name: missing or empty"},
			{`[{"tool_calls": [{"name": "", "arguments": {}}]}]`, "invalid script: turn 0: tool_calls[0].name: missing or empty"},
			{`[{"tool_calls": [{"name": 7}]}]`, "invalid script: turn 0: tool_calls[0].name: must be a string"},
			{`[{"text": ["a"]}]`, "invalid script: turn 0: text: must be a string"},
			{`[{"tool_calls": {"name": "a"}}]`, "invalid script: turn 0: tool_calls: must be an array"},
			{`[{"text": "hi", "text": "again"}]`, "invalid script: turn 0: text: duplicate field"},
			{`[{"tool_calls": [{"name": "a", "arguments": {"k": 1, "k": 2}}]}]`, "invalid script: turn 0: tool_calls[0].arguments.k: duplicate field"},
			{`[{"text": "hi"}, 3]`, "invalid script: turn 1: must be a JSON object"},
			{`[{"text": "hi"`, "invalid script: turn 0: truncated JSON"},
		} {
			_, err := fakeserver.ParseScript([]byte(c.file))
			if !errors.Is(err, fakeserver.ErrInvalidScript) || !strings.HasPrefix(err.Error(), c.want) {
				t.Errorf("%s: error %v, want one starting %q", c.file, err, c.want)
			}
		}
	})
}

// A script given in Go is checked as a file is, naming its turn.
func TestConfigValidateRefusesAnInvalidScript(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		script []fakeserver.ScriptTurn
		want   string
	}{
		{[]fakeserver.ScriptTurn{{Text: "ok"}, {Text: "and", ToolCalls: []fakeserver.ScriptCall{{Name: "a"}}}}, "invalid script: turn 1: has both tool_calls and text; want one of them"},
		{[]fakeserver.ScriptTurn{{ToolCalls: []fakeserver.ScriptCall{{Name: ""}}}}, "invalid script: turn 0: tool_calls[0].name: missing or empty"},
		{[]fakeserver.ScriptTurn{{ToolCalls: []fakeserver.ScriptCall{{Name: "a", Arguments: json.RawMessage(`[1]`)}}}}, "invalid script: turn 0: tool_calls[0].arguments: not a JSON object"},
		{[]fakeserver.ScriptTurn{{ToolCalls: []fakeserver.ScriptCall{{Name: "a", Arguments: json.RawMessage(`{"a":`)}}}}, "invalid script: turn 0: tool_calls[0].arguments: not a JSON object"},
	} {
		err := fakeserver.Config{Script: c.script}.Validate()
		if !errors.Is(err, fakeserver.ErrInvalidScript) || err.Error() != c.want {
			t.Errorf("%+v: %v, want %q", c.script, err, c.want)
		}
		if _, err := fakeserver.New(fakeserver.Config{Script: c.script}); !errors.Is(err, fakeserver.ErrInvalidScript) {
			t.Errorf("New accepted %+v: %v", c.script, err)
		}
	}
	if err := (fakeserver.Config{Script: []fakeserver.ScriptTurn{{ToolCalls: []fakeserver.ScriptCall{{Name: "a"}}}, {}}}).Validate(); err != nil {
		t.Fatalf("a call without arguments and an empty text turn: %v", err)
	}
}

// The script answers by the number of tool results in the conversation, on each wire
// format, plain and streamed: the calls with their names, arguments and fresh distinct
// ids and finish reason tool_calls (stop_reason tool_use), then the text turns with
// stop (end_turn), the last turn once the script runs out; every request counts in
// /stats.
func TestScriptAnswersTheTurnOfTheToolResultCount(t *testing.T) {
	t.Parallel()
	results := []int{0, 1, 2, 3, 7}
	t.Run("adapters", func(t *testing.T) {
		t.Parallel()
		for name, c := range adapters(t, fakeserver.Config{Script: scripted(t)}) {
			for _, stream := range []bool{false, true} {
				for _, n := range results {
					resp := answer(t, c, stream, conversation(n))
					checkTurn(t, fmt.Sprintf("%s stream=%v, %d tool results", name, stream, n), n, resp.ToolCalls, resp.Content, resp.FinishReason)
				}
			}
		}
	})
	t.Run("responses", func(t *testing.T) {
		t.Parallel()
		s, url := start(t, fakeserver.Config{Script: scripted(t)})
		client := sdk(url)
		ctx := context.Background()
		for _, n := range results {
			p := rsConversation(n)
			resp, err := client.Responses.New(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			calls, text, finish := rsAnswer(resp)
			checkTurn(t, fmt.Sprintf("plain, %d tool results", n), n, calls, text, finish)

			stream := client.Responses.NewStreaming(ctx, p)
			deltas := map[int64]string{}
			var final responses.Response
			for stream.Next() {
				switch ev := stream.Current(); ev.Type {
				case "response.function_call_arguments.delta":
					deltas[ev.OutputIndex] += ev.Delta
				case "response.completed":
					final = ev.Response
				}
			}
			if err := stream.Err(); err != nil {
				t.Fatal(err)
			}
			calls, text, finish = rsAnswer(&final)
			checkTurn(t, fmt.Sprintf("streamed, %d tool results", n), n, calls, text, finish)
			for i, c := range calls {
				if deltas[int64(i)] != c.Arguments {
					t.Fatalf("streamed, %d tool results: call %d's deltas %q, arguments %q", n, i, deltas[int64(i)], c.Arguments)
				}
			}
		}
		if st := s.Stats(); st.Requests != int64(2*len(results)) || st.ByEndpoint["responses"] != st.Requests || st.ByStatus["200"] != st.Requests {
			t.Fatalf("stats %+v, want %d requests answered 200", st, 2*len(results))
		}
	})
}

// checkTurn fails the test unless calls, text and finish are agentScript's answer to a
// conversation of n tool results.
func checkTurn(t *testing.T, what string, n int, calls []llm.ToolCall, text, finish string) {
	t.Helper()
	wantCalls, wantText := wantTurn(n)
	if len(wantCalls) == 0 {
		if len(calls) != 0 || text != wantText || finish != llm.FinishStop {
			t.Fatalf("%s: calls %+v, text %q, finish %q; want the text %q", what, calls, text, finish, wantText)
		}
		return
	}
	if len(calls) != len(wantCalls) || text != "" || finish != llm.FinishToolCalls {
		t.Fatalf("%s: calls %+v, text %q, finish %q; want %d calls", what, calls, text, finish, len(wantCalls))
	}
	ids := map[string]bool{}
	for i, c := range calls {
		if c.Name != wantCalls[i].name || !sameJSON(c.Arguments, wantCalls[i].args) || c.ID == "" || ids[c.ID] {
			t.Fatalf("%s: call %d is %+v, want %s(%s) with an id of its own", what, i, c, wantCalls[i].name, wantCalls[i].args)
		}
		ids[c.ID] = true
	}
}

// rsConversation is conversation(n) as Responses API input items: the user message, n
// function_call items and their n function_call_output items.
func rsConversation(n int) responses.ResponseNewParams {
	req := conversation(n)
	items := responses.ResponseInputParam{responses.ResponseInputItemParamOfMessage(req.Messages[0].Content, responses.EasyInputMessageRoleUser)}
	for _, m := range req.Messages[1:] {
		for _, c := range m.ToolCalls {
			items = append(items, responses.ResponseInputItemParamOfFunctionCall(c.Arguments, c.ID, c.Name))
		}
		if m.Role == llm.RoleTool {
			out := responses.ResponseInputItemParamOfFunctionCallOutput(m.Content)
			out.OfFunctionCallOutput.CallID = param.NewOpt(m.ToolCallID)
			items = append(items, out)
		}
	}
	p := responses.ResponseNewParams{Model: "gpt-4.1-mini", Input: responses.ResponseNewParamsInputUnion{OfInputItemList: items}}
	for _, tool := range req.Tools {
		var schema map[string]any
		_ = json.Unmarshal(tool.Parameters, &schema)
		p.Tools = append(p.Tools, responses.ToolParamOfFunction(tool.Name, schema, false))
	}
	return p
}

// rsAnswer reads a response's function calls (call_id as the id), text and, in the
// chat vocabulary, finish reason.
func rsAnswer(resp *responses.Response) (calls []llm.ToolCall, text, finish string) {
	for _, item := range resp.Output {
		if item.Type == "function_call" {
			fc := item.AsFunctionCall()
			calls = append(calls, llm.ToolCall{ID: fc.CallID, Name: fc.Name, Arguments: fc.Arguments})
		}
	}
	finish = llm.FinishStop
	if len(calls) > 0 {
		finish = llm.FinishToolCalls
	}
	return calls, resp.OutputText(), finish
}

// The script's calls take their ids from Config.ToolCallIDs: stable ones repeat for a
// repeated request, plain or streamed, random ones are fresh in every answer; the
// calls of one answer never share an id.
func TestScriptToolCallIDsStableAndRandom(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{fakeserver.ToolCallIDsStable, fakeserver.ToolCallIDsRandom} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			for name, c := range adapters(t, fakeserver.Config{Script: scripted(t), ToolCallIDs: mode}) {
				seen := map[string]int{}
				var first []string
				for i, stream := range []bool{false, false, true} {
					resp := answer(t, c, stream, conversation(0))
					var ids []string
					for _, tc := range resp.ToolCalls {
						ids = append(ids, tc.ID)
						seen[tc.ID]++
					}
					if len(ids) != 2 || ids[0] == ids[1] {
						t.Fatalf("%s: answer %d has ids %v, want two of their own", name, i, ids)
					}
					if i == 0 {
						first = ids
					}
					if mode == fakeserver.ToolCallIDsStable && !reflect.DeepEqual(ids, first) {
						t.Fatalf("%s: answer %d has ids %v, the first had %v (stable: the same)", name, i, ids, first)
					}
				}
				if mode == fakeserver.ToolCallIDsRandom && len(seen) != 6 {
					t.Fatalf("%s: ids %v, want 6 different ones in 3 answers", name, seen)
				}
			}
		})
	}
}

// A script is answered as written: Config.ToolChoice is never asked, a call is sent
// although the request declares no tools or its tool_choice is "none", and scripted
// text gets no sample tag at a temperature above 0. Faults and replays still apply.
func TestScriptTakesPrecedenceOverToolChoice(t *testing.T) {
	t.Parallel()
	var asked atomic.Int64
	chooser := func(*llm.Request) (string, json.RawMessage, bool) {
		asked.Add(1)
		return "", nil, false
	}
	s, url := start(t, fakeserver.Config{Script: scripted(t), ToolChoice: chooser, HonourIdempotency: true})

	t.Run("tool_choice none and no tools", func(t *testing.T) {
		for _, body := range []string{chatBody(`,"tool_choice":"none"` + toolsJSON), chatBody("")} {
			resp, b := post(t, url+"/v1/chat/completions", body)
			c := decode(t, b)
			if resp.StatusCode != 200 || c.Choices[0].FinishReason != "tool_calls" || len(c.Choices[0].Message.ToolCalls) != 2 ||
				c.Choices[0].Message.ToolCalls[0].Function.Name != "lookup_order" {
				t.Fatalf("%s: %d %s, want the script's two calls", body, resp.StatusCode, b)
			}
		}
	})
	t.Run("temperature", func(t *testing.T) {
		one := 1.0
		req := conversation(2)
		req.Temperature = &one
		c := openai.New(openai.Config{BaseURL: url + "/v1", APIKey: "k"})
		if resp := answer(t, c, false, req); resp.Content != "Refunded order A-17: 12.99 EUR." {
			t.Fatalf("content %q, want the scripted text as written", resp.Content)
		}
	})
	t.Run("faults and replays", func(t *testing.T) {
		s.Script(fakeserver.Fault{Kind: fakeserver.Fault503})
		resp, b := post(t, url+"/v1/chat/completions", chatBody(toolsJSON), "Idempotency-Key", "k-script")
		if resp.StatusCode != 503 {
			t.Fatalf("%d %s, want the scripted 503 first", resp.StatusCode, b)
		}
		_, first := post(t, url+"/v1/chat/completions", chatBody(toolsJSON), "Idempotency-Key", "k-script")
		resp, again := post(t, url+"/v1/chat/completions", chatBody(toolsJSON), "Idempotency-Key", "k-script")
		if string(first) != string(again) || resp.Header.Get("Idempotent-Replayed") != "true" || len(decode(t, first).Choices[0].Message.ToolCalls) != 2 {
			t.Fatalf("replay %s, first %s", again, first)
		}
	})
	if n := asked.Load(); n != 0 {
		t.Fatalf("ToolChoice asked %d times under a script, want never", n)
	}
}

// FuzzParseScript feeds arbitrary files to the script parser: it never panics; it
// refuses with ErrInvalidScript, or returns turns that are each calls (named, with
// object arguments) or text, which json.Marshal writes back as a file it reads as
// the same turns (json.Marshal may escape differently: the arguments are compared as
// JSON).
func FuzzParseScript(f *testing.F) {
	f.Add([]byte(agentScript))
	f.Add([]byte(`[{"text": ""}]`))
	f.Add([]byte(`[{"tool_calls": [{"name": "a", "arguments": {"k": [1, {"n": null}]}}]}, {"text": "é\u2028"}]`))
	f.Add([]byte(`[{"tool_calls": []}]`))
	f.Add([]byte(`[{"tool_calls": [{"name": "a", "arguments": [1]}]}]`))
	f.Add([]byte(`[{"text": "a", "tool_calls": null}]`))
	f.Add([]byte(`[{"txt": "a"}]`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, file []byte) {
		turns, err := fakeserver.ParseScript(file)
		if err != nil {
			if !errors.Is(err, fakeserver.ErrInvalidScript) || turns != nil {
				t.Fatalf("error %v with turns %v", err, turns)
			}
			return
		}
		if len(turns) == 0 {
			t.Fatal("no turns accepted")
		}
		for i, turn := range turns {
			if len(turn.ToolCalls) > 0 && turn.Text != "" {
				t.Fatalf("turn %d has calls and text", i)
			}
			for _, c := range turn.ToolCalls {
				var obj map[string]any
				if c.Name == "" || json.Unmarshal(c.Arguments, &obj) != nil || obj == nil {
					t.Fatalf("turn %d: call %+v accepted", i, c)
				}
			}
		}
		if err := (fakeserver.Config{Script: turns}).Validate(); err != nil {
			t.Fatalf("parsed turns fail Validate: %v", err)
		}
		out, err := json.Marshal(turns)
		if err != nil {
			t.Fatal(err)
		}
		again, err := fakeserver.ParseScript(out)
		if err != nil || len(again) != len(turns) {
			t.Fatalf("%s read back as %+v, %v; was %+v", out, again, err, turns)
		}
		for i := range turns {
			a, b := again[i], turns[i]
			same := a.Text == b.Text && len(a.ToolCalls) == len(b.ToolCalls)
			for j := 0; same && j < len(a.ToolCalls); j++ {
				same = a.ToolCalls[j].Name == b.ToolCalls[j].Name && sameJSON(string(a.ToolCalls[j].Arguments), string(b.ToolCalls[j].Arguments))
			}
			if !same {
				t.Fatalf("%s: turn %d read back as %+v; was %+v", out, i, a, b)
			}
		}
	})
}
