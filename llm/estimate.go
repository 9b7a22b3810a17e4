package llm

import "unicode/utf8"

// DefaultOutputTokens is the output EstimateTokens reserves for a request that sets no
// MaxTokens: the answer's length is then the provider's choice, so a limiter can only
// reserve a typical bound and correct it from the answer's usage.
const DefaultOutputTokens = 1024

// EstimateInputTokens estimates the prompt tokens of req before it is sent, the way
// providers' rate limiters do (they count tokens before they run the tokenizer): one
// token per four characters (Unicode code points) of each message's content and of
// each tool call's name and arguments, rounded up, plus 4 per message for its framing,
// plus 3 that prime the reply, plus one token per four bytes of each tool's name,
// description and parameter schema. English prose tokenises at about four characters a
// token, so the estimate is close for it; text that tokenises densely (code, CJK) can
// take more tokens than estimated, which the answer's usage corrects. It never fails
// and is safe for concurrent use.
func EstimateInputTokens(req *Request) int {
	if req == nil {
		return 0
	}
	n := 3
	for _, m := range req.Messages {
		chars := utf8.RuneCountInString(m.Content)
		for _, tc := range m.ToolCalls {
			chars += utf8.RuneCountInString(tc.Name) + utf8.RuneCountInString(tc.Arguments)
		}
		n += 4 + (chars+3)/4
	}
	for _, t := range req.Tools {
		n += (len(t.Name) + len(t.Description) + len(t.Parameters) + 3) / 4
	}
	return n
}

// EstimateTokens is what a call of req can cost at most in tokens, by the estimate:
// EstimateInputTokens plus the output it may produce, MaxTokens or, when that is not
// set, DefaultOutputTokens.
func EstimateTokens(req *Request) int {
	if req == nil {
		return 0
	}
	out := req.MaxTokens
	if out <= 0 {
		out = DefaultOutputTokens
	}
	return EstimateInputTokens(req) + out
}
