package fakeserver

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/onceflow/onceflow/internal/strictjson"
	"github.com/onceflow/onceflow/llm"
)

// ScriptTurn is one answer of a scripted model (Config.Script, `onceflow fake-llm
// --script FILE`): tool calls, or text when it has none. In a script file a turn is
// {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} or {"text": ...}; its JSON
// form (MarshalJSON) is the same, so ParseScript reads back what json.Marshal writes.
type ScriptTurn struct {
	// ToolCalls are the calls the answer makes, in order, each with an id the server
	// gives it (Config.ToolCallIDs). A turn without calls is a text turn.
	ToolCalls []ScriptCall
	// Text is the answer of a text turn, sent as written (it may be empty). A turn
	// with tool calls must leave it empty.
	Text string
}

// ScriptCall is one tool call of a ScriptTurn.
type ScriptCall struct {
	// Name is the tool called; it must not be empty. It need not be a tool the
	// request declares (a model may call a tool it was not offered).
	Name string `json:"name"`
	// Arguments is a JSON object; nil means {}.
	Arguments json.RawMessage `json:"arguments,omitempty"`
}

// MarshalJSON writes t as a script file holds it: {"tool_calls": [...]} or
// {"text": ...} (a text turn keeps its "text" even when it is empty).
func (t ScriptTurn) MarshalJSON() ([]byte, error) {
	if len(t.ToolCalls) > 0 {
		return json.Marshal(struct {
			ToolCalls []ScriptCall `json:"tool_calls"`
		}{t.ToolCalls})
	}
	return json.Marshal(struct {
		Text string `json:"text"`
	}{t.Text})
}

// ErrInvalidScript is matched (errors.Is) by the errors of ParseScript and of
// Config.Validate for a script it refuses; the message names the turn (numbered from
// 0, as a request's count of tool results selects it) and the field.
var ErrInvalidScript = errors.New("invalid script")

// ParseScript reads a script file: a non-empty JSON array of turns, each
// {"tool_calls": [{"name": "...", "arguments": {...}}, ...]} (at least one call, each
// naming its tool; arguments a JSON object, absent meaning {}) or {"text": "..."},
// never both. It is strict: an unknown or repeated member, a value of the wrong type,
// invalid UTF-8 or data after the array is refused. Its errors match ErrInvalidScript
// and name the turn and the field ("invalid script: turn 2: tool_calls[0].arguments:
// not a JSON object"). The arguments are returned compacted. It never panics and is
// safe for concurrent use.
func ParseScript(data []byte) ([]ScriptTurn, error) {
	type fileTurn struct {
		// Pointers tell an absent member (or null) from an empty one.
		ToolCalls *[]ScriptCall `json:"tool_calls"`
		Text      *string       `json:"text"`
	}
	var in []fileTurn
	if err := strictjson.Decode(data, &in); err != nil {
		return nil, scriptDecodeError(err)
	}
	if len(in) == 0 {
		return nil, fmt.Errorf("%w: no turns; want a JSON array of at least one turn", ErrInvalidScript)
	}
	turns := make([]ScriptTurn, len(in))
	for i, t := range in {
		switch {
		case t.ToolCalls != nil && t.Text != nil:
			return nil, fmt.Errorf("%w: turn %d: has both tool_calls and text; want one of them", ErrInvalidScript, i)
		case t.ToolCalls == nil && t.Text == nil:
			return nil, fmt.Errorf(`%w: turn %d: has neither tool_calls nor text; want {"tool_calls": [...]} or {"text": "..."}`, ErrInvalidScript, i)
		case t.Text != nil:
			turns[i].Text = *t.Text
			continue
		case len(*t.ToolCalls) == 0:
			return nil, fmt.Errorf(`%w: turn %d: tool_calls is empty; a turn without calls is {"text": "..."}`, ErrInvalidScript, i)
		}
		turns[i].ToolCalls = *t.ToolCalls
		if err := checkTurn(i, turns[i]); err != nil {
			return nil, err
		}
		for j := range turns[i].ToolCalls {
			turns[i].ToolCalls[j].Arguments = json.RawMessage(callArguments(turns[i].ToolCalls[j]))
		}
	}
	return turns, nil
}

// checkScript is Config.Validate's check of Config.Script.
func checkScript(turns []ScriptTurn) error {
	for i, t := range turns {
		if err := checkTurn(i, t); err != nil {
			return err
		}
	}
	return nil
}

// checkTurn reports what is wrong with turn i: text beside tool calls, a call without
// a name, arguments that are not a JSON object.
func checkTurn(i int, t ScriptTurn) error {
	if len(t.ToolCalls) > 0 && t.Text != "" {
		return fmt.Errorf("%w: turn %d: has both tool_calls and text; want one of them", ErrInvalidScript, i)
	}
	for j, c := range t.ToolCalls {
		if c.Name == "" {
			return fmt.Errorf("%w: turn %d: tool_calls[%d].name: missing or empty", ErrInvalidScript, i, j)
		}
		if c.Arguments == nil {
			continue
		}
		if !json.Valid(c.Arguments) || bytes.TrimLeft(c.Arguments, " \t\r\n")[0] != '{' {
			return fmt.Errorf("%w: turn %d: tool_calls[%d].arguments: not a JSON object", ErrInvalidScript, i, j)
		}
	}
	return nil
}

// callArguments is c's arguments compacted, {} when it has none; c has passed
// checkTurn.
func callArguments(c ScriptCall) string {
	if c.Arguments == nil {
		return "{}"
	}
	var buf bytes.Buffer
	_ = json.Compact(&buf, c.Arguments)
	return buf.String()
}

// scriptDecodeError words a strictjson error by turn and field: the path
// "2.tool_calls.0.arguments" reads "turn 2: tool_calls[0].arguments".
func scriptDecodeError(err error) error {
	var se *strictjson.Error
	if !errors.As(err, &se) {
		return fmt.Errorf("%w: %v", ErrInvalidScript, err)
	}
	if se.Field == "" {
		msg := se.Msg
		if se.Kind == strictjson.KindType {
			msg += " of turns"
		}
		return fmt.Errorf("%w: %s", ErrInvalidScript, msg)
	}
	parts := strings.Split(se.Field, ".")
	var field strings.Builder
	for _, p := range parts[1:] {
		if _, err := strconv.Atoi(p); err == nil && field.Len() > 0 {
			field.WriteString("[" + p + "]")
			continue
		}
		if field.Len() > 0 {
			field.WriteByte('.')
		}
		field.WriteString(p)
	}
	where := "turn " + parts[0]
	if field.Len() > 0 {
		where += ": " + field.String()
	}
	return fmt.Errorf("%w: %s: %s", ErrInvalidScript, where, se.Msg)
}

// turn is a script turn ready to answer: its calls (arguments compacted, no ids yet)
// or its text.
type turn struct {
	calls []llm.ToolCall
	text  string
}

// compileScript prepares Config.Script, which has passed checkScript.
func compileScript(script []ScriptTurn) []turn {
	out := make([]turn, len(script))
	for i, t := range script {
		out[i].text = t.Text
		for _, c := range t.ToolCalls {
			out[i].calls = append(out[i].calls, llm.ToolCall{Name: c.Name, Arguments: callArguments(c)})
		}
	}
	return out
}

// scriptTurn returns the index of the turn that answers req: its count of tool
// results, the last turn once the script is exhausted.
func (s *Server) scriptTurn(req *chatRequest) int {
	return min(req.ToolResults, len(s.turns)-1)
}
