package ledger

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"net/url"

	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/toolkey"
)

// KeyPrefix starts every key Key derives; onceflow gateway's keys start with "gw-".
const KeyPrefix = "llm-"

// Work names one model call of a job: the job id and the step of the job that makes the
// call ("summarise", "classify", "agent-turn-3"). It is unambiguous: the step is
// path-escaped before the slash, so no two (jobID, step) pairs give one work string.
// The result is what llm.Request.IdempotencyKey carries into Client, and what the
// ledger row's work column shows.
func Work(jobID, step string) string { return url.PathEscape(step) + "/" + jobID }

// Key returns the ledger key of one model call: derived from the work (job id and step,
// see Work) and RequestHash(req), never from the attempt, so every retry and every
// redelivery of the same work with the same request finds the same row, while a changed
// request (a new prompt version after a deploy) is a new call. The key is "llm-" and 64
// lower-case hex characters: printable ASCII that fits every common Idempotency-Key
// limit, so Client also sends it as the provider's Idempotency-Key.
func Key(work string, req *llm.Request) string {
	h := sha256.New()
	var n [8]byte
	for _, p := range []string{"onceflow.ledger.v1", work, RequestHash(req)} {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
	return KeyPrefix + hex.EncodeToString(h.Sum(nil))
}

// canonicalRequest is what RequestHash hashes: everything that changes the answer.
type canonicalRequest struct {
	V           int                `json:"v"`
	Model       string             `json:"model"`
	Messages    []canonicalMessage `json:"messages"`
	Temperature *float64           `json:"temperature"`
	MaxTokens   int                `json:"max_tokens"`
	Tools       []canonicalTool    `json:"tools"`
}

type canonicalMessage struct {
	Role       llm.Role        `json:"role"`
	Content    string          `json:"content"`
	ToolCalls  []canonicalCall `json:"tool_calls"`
	ToolCallID string          `json:"tool_call_id"`
}

type canonicalCall struct {
	ID        string        `json:"id"`
	Name      string        `json:"name"`
	Arguments canonicalJSON `json:"arguments"`
}

type canonicalTool struct {
	Name        string        `json:"name"`
	Description string        `json:"description"`
	Parameters  canonicalJSON `json:"parameters"`
}

// canonicalJSON holds embedded JSON by value, or, when it is not JSON, its exact text in
// another field, so that no JSON value and no invalid text hash alike.
type canonicalJSON struct {
	JSON json.RawMessage `json:"json"`
	Text string          `json:"text"`
}

// RequestHash returns the lower-case hex SHA-256 of the canonical form of req: the
// model, the messages (roles, contents, tool calls and the ids they answer) and the
// parameters (temperature, max tokens, tools). JSON inside the request (tool parameter
// schemas, tool-call arguments) is compared by value (toolkey.CanonicalJSON), so
// re-encoding it does not change the hash. IdempotencyKey is not part of the request.
// An empty Model hashes as empty: name the model explicitly when a changed default
// must count as a new request. Safe for concurrent use; never fails.
func RequestHash(req *llm.Request) string {
	c := canonicalRequest{V: 1, Model: req.Model, Temperature: req.Temperature, MaxTokens: req.MaxTokens}
	for _, m := range req.Messages {
		cm := canonicalMessage{Role: m.Role, Content: m.Content, ToolCallID: m.ToolCallID}
		for _, tc := range m.ToolCalls {
			cm.ToolCalls = append(cm.ToolCalls, canonicalCall{ID: tc.ID, Name: tc.Name, Arguments: canonicalOf(tc.Arguments)})
		}
		c.Messages = append(c.Messages, cm)
	}
	for _, t := range req.Tools {
		c.Tools = append(c.Tools, canonicalTool{Name: t.Name, Description: t.Description, Parameters: canonicalOf(string(t.Parameters))})
	}
	b, _ := json.Marshal(c) // plain structs of strings and numbers always encode
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// canonicalOf is the canonical JSON of s when s is JSON, else s's exact text (so invalid
// JSON still hashes).
func canonicalOf(s string) canonicalJSON {
	if c, err := toolkey.CanonicalJSON([]byte(s)); err == nil {
		return canonicalJSON{JSON: c}
	}
	return canonicalJSON{JSON: json.RawMessage(`null`), Text: s}
}
