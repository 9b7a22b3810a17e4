package limiter

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// DefaultPrices are list prices in US dollars per million tokens (input, output) of a
// few common models, as published by their providers when this table was written
// (2025): check them against your contract and override them with Config.Prices
// (ONCEFLOW_LLM_PRICES). A model in neither costs 0 in the cost view.
var DefaultPrices = map[string]Price{
	"gpt-4.1":           {Input: 2.00, Output: 8.00},
	"gpt-4.1-mini":      {Input: 0.40, Output: 1.60},
	"gpt-4.1-nano":      {Input: 0.10, Output: 0.40},
	"gpt-4o":            {Input: 2.50, Output: 10.00},
	"gpt-4o-mini":       {Input: 0.15, Output: 0.60},
	"claude-sonnet-4-0": {Input: 3.00, Output: 15.00},
	"claude-opus-4-0":   {Input: 15.00, Output: 75.00},
	"claude-3-5-haiku":  {Input: 0.80, Output: 4.00},
}

// ParseModelLimits reads per-model limits (ONCEFLOW_LLM_LIMITS): entries separated by
// ";", each a model name then its limits as key=value, separated by spaces, keys rpm,
// tpm and concurrency:
//
//	gpt-4.1-mini rpm=5000 tpm=2000000; claude-sonnet-4-0 rpm=50 concurrency=8
//
// A limit an entry does not name is 0 (none configured; still learnt from the
// provider's headers); a model not listed takes the default limits. An empty s gives
// an empty map. Errors name the entry.
func ParseModelLimits(s string) (map[string]Limits, error) {
	out := map[string]Limits{}
	err := entries(s, func(model string, kv map[string]string) error {
		var l Limits
		for k, v := range kv {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return fmt.Errorf("%s=%q is not a non-negative integer", k, v)
			}
			switch k {
			case "rpm":
				l.RPM = n
			case "tpm":
				l.TPM = n
			case "concurrency":
				l.Concurrency = n
			default:
				return fmt.Errorf("unknown limit %q (rpm, tpm, concurrency)", k)
			}
		}
		out[model] = l
		return nil
	})
	return out, err
}

// ParsePrices reads a price table (ONCEFLOW_LLM_PRICES) in the format of
// ParseModelLimits, keys input and output in US dollars per million tokens, and
// batch_input and batch_output for the batch API's prices (default: half of each):
//
//	gpt-4.1-mini input=0.40 output=1.60; my-finetune input=3 output=12 batch_input=2
//
// A price an entry does not name is 0. Errors name the entry.
func ParsePrices(s string) (map[string]Price, error) {
	out := map[string]Price{}
	err := entries(s, func(model string, kv map[string]string) error {
		var p Price
		for k, v := range kv {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
				return fmt.Errorf("%s=%q is not a non-negative number", k, v)
			}
			switch k {
			case "input":
				p.Input = f
			case "output":
				p.Output = f
			case "batch_input":
				p.BatchInput = f
			case "batch_output":
				p.BatchOutput = f
			default:
				return fmt.Errorf("unknown price %q (input, output, batch_input, batch_output)", k)
			}
		}
		out[model] = p
		return nil
	})
	return out, err
}

// entries splits s into "model key=value ..." entries and calls f for each.
func entries(s string, f func(model string, kv map[string]string) error) error {
	seen := map[string]bool{}
	for i, e := range strings.Split(s, ";") {
		fields := strings.Fields(e)
		if len(fields) == 0 {
			continue
		}
		model := fields[0]
		if err := checkName("model", model); err != nil {
			return fmt.Errorf("entry %d: %w", i+1, err)
		}
		if strings.Contains(model, "=") {
			return fmt.Errorf("entry %d (%q): it must start with a model name", i+1, clip(strings.TrimSpace(e)))
		}
		if seen[model] {
			return fmt.Errorf("entry %d: model %s is listed twice", i+1, model)
		}
		seen[model] = true
		kv := map[string]string{}
		for _, f := range fields[1:] {
			k, v, ok := strings.Cut(f, "=")
			if !ok || k == "" {
				return fmt.Errorf("entry %d (%s): %q is not key=value", i+1, model, clip(f))
			}
			if _, dup := kv[k]; dup {
				return fmt.Errorf("entry %d (%s): %s is given twice", i+1, model, k)
			}
			kv[k] = v
		}
		if err := f(model, kv); err != nil {
			return fmt.Errorf("entry %d (%s): %w", i+1, model, err)
		}
	}
	return nil
}
