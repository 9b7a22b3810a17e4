package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/toolkey"
)

// downstream is the system a tool writes to (a payment API): it honours
// Idempotency-Key, performing the side effect once per key.
type downstream struct {
	mu       sync.Mutex
	requests int
	effects  map[string]string // key -> body of the effect performed
}

func newDownstream(t *testing.T) (*downstream, string) {
	t.Helper()
	d := &downstream{effects: map[string]string{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		d.mu.Lock()
		defer d.mu.Unlock()
		d.requests++
		if key == "" {
			http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
			return
		}
		if _, done := d.effects[key]; done {
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(http.StatusOK)
			return
		}
		d.effects[key] = string(body) // the side effect: a refund issued
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(srv.Close)
	return d, srv.URL
}

func (d *downstream) counts() (requests, effects int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.requests, len(d.effects)
}

var errCrashed = errors.New("the process died after the refund went out, before the step was recorded")

// TestRetryingAToolCallWithoutADuplicateSideEffect is the test docs/providers.md describes: a model request
// that returns a tool call is retried (the first attempt's outcome is lost: it died
// after calling the tool), the same tool call comes back from a second generation, and
// the downstream service that honours Idempotency-Key performs the side effect once.
// With `fake-llm --tool-call-ids stable` the id-derived key dedups; with `random`, the
// id changes, the fallback (tool name + canonical arguments) still dedups, and the
// ledger detects that the ids are unstable. The last case keys on the unstable id and
// shows the duplicate the fallback prevents.
func TestRetryingAToolCallWithoutADuplicateSideEffect(t *testing.T) {
	t.Parallel()
	type keyer func(ctx context.Context, l *ledger.Ledger, requestKey string, calls []llm.ToolCall) ([]string, []toolkey.Stability, error)
	viaLedger := func(ctx context.Context, l *ledger.Ledger, requestKey string, calls []llm.ToolCall) ([]string, []toolkey.Stability, error) {
		tk, err := l.ToolKeys(ctx, "openai", requestKey, calls)
		if err != nil {
			return nil, nil, err
		}
		keys, stab := make([]string, len(tk)), make([]toolkey.Stability, len(tk))
		for i, k := range tk {
			keys[i], stab[i] = k.Key, k.Stability
		}
		return keys, stab, nil
	}
	pure := func(f func(requestKey string, c llm.ToolCall) string) keyer {
		return func(_ context.Context, _ *ledger.Ledger, requestKey string, calls []llm.ToolCall) ([]string, []toolkey.Stability, error) {
			keys := make([]string, len(calls))
			for i, c := range calls {
				keys[i] = f(requestKey, c)
			}
			return keys, make([]toolkey.Stability, len(calls)), nil
		}
	}
	byID := pure(func(rk string, c llm.ToolCall) string { return toolkey.IDKey(rk, c.ID) })
	byArgs := pure(toolkey.ArgsKey)

	for _, tc := range []struct {
		name          string
		ids           string
		key           keyer
		wantEffects   int
		wantStability toolkey.Stability // of the retry's sight, through the ledger
	}{
		{"stable ids, ledger keys", fakeserver.ToolCallIDsStable, viaLedger, 1, toolkey.Stable},
		{"stable ids, id key", fakeserver.ToolCallIDsStable, byID, 1, toolkey.Unknown},
		{"random ids, ledger keys", fakeserver.ToolCallIDsRandom, viaLedger, 1, toolkey.Unstable},
		{"random ids, fallback key", fakeserver.ToolCallIDsRandom, byArgs, 1, toolkey.Unknown},
		{"random ids, id key: the duplicate", fakeserver.ToolCallIDsRandom, byID, 2, toolkey.Unknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fake, adapter := fakeLLM(t, fakeserver.Config{ToolCallIDs: tc.ids})
			reg := prometheus.NewRegistry()
			l, _ := newLedger(t, ledger.Config{Registerer: reg})
			ctx := ctxT(t)
			down, downURL := newDownstream(t)
			req := &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "Customer 881 asks for a refund of order A-17."}},
				Tools: []llm.Tool{{Name: "refund", Description: "Refund an order",
					Parameters: []byte(`{"type":"object","properties":{"order":{"type":"string"},"amount":{"type":"number"}},"required":["order","amount"]}`)}}}
			requestKey := ledger.Key(ledger.Work("ticket-881", "refund"), req)
			req.IdempotencyKey = requestKey

			var seen [][]llm.ToolCall
			var lastStability []toolkey.Stability
			step := func(crash bool) error {
				resp, err := adapter.Complete(ctx, req) // the provider ignores the key: a new generation each time
				if err != nil {
					return err
				}
				if len(resp.ToolCalls) != 1 {
					return fmt.Errorf("answer without a tool call: %+v", resp)
				}
				seen = append(seen, resp.ToolCalls)
				keys, stab, err := tc.key(ctx, l, requestKey, resp.ToolCalls)
				if err != nil {
					return err
				}
				lastStability = stab
				for i, call := range resp.ToolCalls {
					hr, _ := http.NewRequestWithContext(ctx, http.MethodPost, downURL+"/refunds", strings.NewReader(call.Arguments))
					hr.Header.Set("Idempotency-Key", keys[i])
					res, err := http.DefaultClient.Do(hr)
					if err != nil {
						return err
					}
					res.Body.Close()
					if res.StatusCode >= 300 {
						return fmt.Errorf("downstream: %s", res.Status)
					}
				}
				if crash {
					return errCrashed
				}
				return nil
			}
			if err := step(true); !errors.Is(err, errCrashed) {
				t.Fatalf("first attempt: %v", err)
			}
			if err := step(false); err != nil {
				t.Fatalf("retry: %v", err)
			}

			if st := fake.Stats(); st.Requests != 2 {
				t.Fatalf("fake-llm answered %d requests, want 2 (the retry is a second generation)", st.Requests)
			}
			sameID := seen[0][0].ID == seen[1][0].ID
			if sameID != (tc.ids == fakeserver.ToolCallIDsStable) {
				t.Fatalf("ids %q and %q with --tool-call-ids %s", seen[0][0].ID, seen[1][0].ID, tc.ids)
			}
			if toolkey.ArgsKey(requestKey, seen[0][0]) != toolkey.ArgsKey(requestKey, seen[1][0]) {
				t.Fatalf("the same tool call did not come back: %+v vs %+v", seen[0][0], seen[1][0])
			}
			requests, effects := down.counts()
			if requests != 2 || effects != tc.wantEffects {
				t.Fatalf("downstream: %d requests, %d effects; want 2 and %d", requests, effects, tc.wantEffects)
			}
			if lastStability[0] != tc.wantStability {
				t.Fatalf("the retry's sight proved ids %v, want %v", lastStability[0], tc.wantStability)
			}
			if tc.wantStability == toolkey.Unstable {
				if v := counterValue(t, reg, "onceflow_llm_tool_call_ids_total", map[string]string{"provider": "openai", "stability": "unstable"}); v != 1 {
					t.Fatalf("tool_call_ids_total{unstable} = %v", v)
				}
			}
			// The pure Compare agrees with what the ledger detected.
			if got := toolkey.Compare(seen[0], seen[1]); (got == toolkey.Stable) != (tc.ids == fakeserver.ToolCallIDsStable) {
				t.Fatalf("Compare = %v", got)
			}
		})
	}
}

func TestToolKeysKeepsRepeatedCallsApart(t *testing.T) {
	t.Parallel()
	l, _ := newLedger(t, ledger.Config{})
	ctx := ctxT(t)
	twice := []llm.ToolCall{
		{ID: "c1", Name: "send_email", Arguments: `{"to":"a@example.com"}`},
		{ID: "c2", Name: "send_email", Arguments: `{"to": "a@example.com"}`},
		{Name: "no_id", Arguments: `{}`},
	}
	keys, err := l.ToolKeys(ctx, "openai", "req-1", twice)
	if err != nil {
		t.Fatal(err)
	}
	if keys[0].Key == keys[1].Key || keys[0].Key != toolkey.IDKey("req-1", "c1") || keys[2].Key != toolkey.ArgsKey("req-1", twice[2]) {
		t.Fatalf("keys %+v", keys)
	}
	// The same answer again (a replay): the same keys, ids proven stable.
	again, err := l.ToolKeys(ctx, "openai", "req-1", twice)
	if err != nil {
		t.Fatal(err)
	}
	for i := range twice[:2] {
		if again[i].Key != keys[i].Key || again[i].Stability != toolkey.Stable {
			t.Fatalf("call %d again: %+v", i, again[i])
		}
	}
}
