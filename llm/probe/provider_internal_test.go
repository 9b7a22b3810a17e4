package probe

import (
	"testing"

	"github.com/onceflow/onceflow/llm/openai"
)

// The probe names its endpoints' errors as the OpenAI adapter does, without importing it.
func TestProviderIsTheOpenAIAdapters(t *testing.T) {
	if provider != openai.Provider {
		t.Fatalf("provider %q, llm/openai's %q", provider, openai.Provider)
	}
}
