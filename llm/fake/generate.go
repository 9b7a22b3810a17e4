package fake

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/onceflow/onceflow/llm"
)

// summaryWords is how many words of the prompt a summary keeps.
const summaryWords = 12

// Prompt returns the text the fake models answer: the last user message, or all
// messages' content joined when there is no user message.
func Prompt(msgs []llm.Message) string {
	for i := len(msgs) - 1; i >= 0; i-- {
		if msgs[i].Role == llm.RoleUser {
			return msgs[i].Content
		}
	}
	var parts []string
	for _, m := range msgs {
		parts = append(parts, m.Content)
	}
	return strings.Join(parts, "\n")
}

// Summary returns the deterministic summary both fakes (this package and fakeserver)
// give for prompt: a tag derived from the whole prompt, then its first words. An
// instruction line ending in a colon ("Summarise for the account team:") is skipped,
// so the summary shows the text being summarised.
func Summary(prompt string) string {
	text := prompt
	if head, rest, ok := strings.Cut(prompt, "\n"); ok && strings.HasSuffix(strings.TrimSpace(head), ":") && strings.TrimSpace(rest) != "" {
		text = rest
	}
	words := strings.Fields(text)
	sum := sha256.Sum256([]byte(prompt))
	tag := hex.EncodeToString(sum[:4])
	if len(words) == 0 {
		return fmt.Sprintf("Summary %s: (empty text)", tag)
	}
	kept := words[:min(len(words), summaryWords)]
	s := fmt.Sprintf("Summary %s: %s", tag, strings.Join(kept, " "))
	if len(words) > len(kept) {
		s += " …"
	}
	return s + fmt.Sprintf(" (%d words)", len(words))
}

// ToolArguments returns deterministic JSON arguments for a tool whose parameters are
// the JSON Schema schema: every declared property gets a value derived from its type
// and from prompt (strings the summary, integers and numbers the prompt's word count,
// booleans true, arrays and objects empty). A schema without properties gives {}.
func ToolArguments(schema json.RawMessage, prompt string) string {
	var s struct {
		Properties map[string]struct {
			Type any `json:"type"`
		} `json:"properties"`
	}
	_ = json.Unmarshal(schema, &s) // anything unreadable is a schema without properties
	args := map[string]any{}
	names := make([]string, 0, len(s.Properties))
	for name := range s.Properties {
		names = append(names, name)
	}
	slices.Sort(names)
	words := len(strings.Fields(prompt))
	for _, name := range names {
		typ, _ := s.Properties[name].Type.(string)
		switch typ {
		case "integer", "number":
			args[name] = words
		case "boolean":
			args[name] = true
		case "array":
			args[name] = []any{}
		case "object":
			args[name] = map[string]any{}
		default:
			args[name] = Summary(prompt)
		}
	}
	b, _ := json.Marshal(args) // map keys are sorted: deterministic
	return string(b)
}

// RequestHash returns a stable hex digest of what a request asks (model, messages,
// tools, temperature, max tokens), for deterministic ids.
func RequestHash(req *llm.Request) string {
	b, _ := json.Marshal(struct {
		Model       string        `json:"model"`
		Messages    []llm.Message `json:"messages"`
		Tools       []llm.Tool    `json:"tools"`
		Temperature *float64      `json:"temperature"`
		MaxTokens   int           `json:"max_tokens"`
	}{req.Model, req.Messages, req.Tools, req.Temperature, req.MaxTokens})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// EstimateTokens is the fakes' token count: a quarter of the characters, rounded up.
func EstimateTokens(s string) int { return (len([]rune(s)) + 3) / 4 }
