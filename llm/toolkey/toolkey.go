// Package toolkey derives the idempotency key a tool call carries downstream, so that a
// retried model request that produces the same tool call produces the same downstream
// key, and the system the tool writes to (a payment API, an email provider, your own
// service) rejects the duplicate (docs/providers.md, "Tool calls: carry the key downstream").
//
// Two derivations, both from the key of the model request that produced the call (for
// onceflow, the ledger key: derived from the work, never from the attempt):
//
//   - IDKey, from the provider's tool-call id. Right when the provider gives a repeated
//     request the same id (or replays the response, as a provider or onceflow gateway
//     honouring Idempotency-Key does). Distinguishes two identical calls in one answer.
//   - ArgsKey, the fallback, from the tool name and the canonical JSON of the
//     arguments (CanonicalJSON: key order, whitespace, string escapes and number
//     spelling do not matter). Right when the ids change from one generation to the
//     next, as most providers' do.
//
// Compare tells whether a provider's ids are stable: given the calls of two answers to
// the same request, it matches calls by ArgsKey and compares their ids. ledger's
// ToolKeys does that durably across attempts and processes, and keeps the first key.
//
// Keys are "tool-" and 64 lower-case hex characters: printable ASCII, within every
// common Idempotency-Key length limit (onceflow's 16 to 128, Stripe's 255).
package toolkey

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/onceflow/onceflow/llm"
)

// Prefix starts every key.
const Prefix = "tool-"

// IDKey returns the downstream key of the tool call whose provider id is callID, made
// by the model request whose key is requestKey. It is deterministic and injective in
// its inputs (they are length-prefixed before hashing), and safe for concurrent use.
func IDKey(requestKey, callID string) string {
	return derive("id", requestKey, callID)
}

// ArgsKey returns the fallback downstream key of call, from requestKey, the tool name
// and the canonical JSON of its arguments: the same call spelled differently (keys
// reordered, whitespace, 1.0 for 1) gets the same key. Arguments that are not valid
// JSON (a model can produce those) are keyed by their exact bytes, so only an identical
// repeat matches. The call's id is ignored. Two identical calls in one answer get one
// key: they count as one effect.
func ArgsKey(requestKey string, call llm.ToolCall) string {
	canon, err := CanonicalJSON([]byte(call.Arguments))
	form := "json"
	if err != nil {
		canon, form = []byte(call.Arguments), "raw"
	}
	return derive("args", requestKey, call.Name, form, string(canon))
}

// Key returns IDKey when trustIDs is set and the call has an id, else ArgsKey.
func Key(requestKey string, call llm.ToolCall, trustIDs bool) string {
	if trustIDs && call.ID != "" {
		return IDKey(requestKey, call.ID)
	}
	return ArgsKey(requestKey, call)
}

// derive hashes a kind and length-prefixed parts into a key.
func derive(kind string, parts ...string) string {
	h := sha256.New()
	var n [8]byte
	for _, p := range append([]string{"onceflow.toolkey.v1", kind}, parts...) {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
	return Prefix + hex.EncodeToString(h.Sum(nil))
}

// Stability is what Compare concludes about a provider's tool-call ids.
type Stability int

const (
	// Unknown: the two answers share no call (same tool and arguments), so their ids
	// say nothing; or a call had no id.
	Unknown Stability = iota
	// Stable: every shared call kept its id.
	Stable
	// Unstable: a shared call came back with another id. Key downstream effects with
	// ArgsKey (or through ledger's ToolKeys), never with IDKey alone.
	Unstable
)

// String returns "unknown", "stable" or "unstable".
func (s Stability) String() string {
	switch s {
	case Stable:
		return "stable"
	case Unstable:
		return "unstable"
	}
	return "unknown"
}

// Compare matches the calls of two answers to one request by ArgsKey (requestKey does
// not change the outcome) and compares their ids. It returns Unstable as soon as one
// shared call changed id, Stable when every shared call kept it, Unknown when none is
// shared. Calls repeated within one answer are matched in order.
func Compare(first, second []llm.ToolCall) Stability {
	ids := map[string][]string{}
	for _, c := range first {
		k := ArgsKey("", c)
		ids[k] = append(ids[k], c.ID)
	}
	out := Unknown
	for _, c := range second {
		k := ArgsKey("", c)
		prev := ids[k]
		if len(prev) == 0 {
			continue
		}
		ids[k] = prev[1:]
		if prev[0] == "" || c.ID == "" {
			continue
		}
		if prev[0] != c.ID {
			return Unstable
		}
		out = Stable
	}
	return out
}

// JobKey returns the content-addressed key of a tool call made by a job: from the
// tenant and the job id, the tool name, the canonical JSON of the arguments (as ArgsKey)
// and occurrence, which of the job's identical calls (same tool, same canonical
// arguments) this is, counting from 0. It depends on nothing a provider or a history
// can change: not the tool-call id, not the request, not the call's position in a
// conversation. onceflow's Job.ToolCalls keys a job's calls with it.
func JobKey(tenant, jobID string, call llm.ToolCall, occurrence int) string {
	canon, err := CanonicalJSON([]byte(call.Arguments))
	form := "json"
	if err != nil {
		canon, form = []byte(call.Arguments), "raw"
	}
	return derive("job", tenant, jobID, call.Name, form, string(canon), strconv.Itoa(occurrence))
}

// ContentKey identifies a call by its tool name and canonical arguments alone, for
// counting identical calls (JobKey's occurrence).
func ContentKey(call llm.ToolCall) string { return ArgsKey("", call) }

// CallID returns the stable tool-call id of the call keyed key (JobKey): "call_" and 24
// hex characters of the key, the id a canonical conversation gives the call in place of
// the provider's, so that every delivery sends the same request.
func CallID(key string) string {
	h := strings.TrimPrefix(key, Prefix)
	return "call_" + h[:min(24, len(h))]
}
