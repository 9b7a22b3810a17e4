package limiter

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestParseModelLimits(t *testing.T) {
	m, err := ParseModelLimits(" gpt-4.1-mini rpm=500 tpm=200000; ft:gpt-4o:acme:x concurrency=8 ;; ")
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 2 || m["gpt-4.1-mini"] != (Limits{RPM: 500, TPM: 200000}) || m["ft:gpt-4o:acme:x"] != (Limits{Concurrency: 8}) {
		t.Fatalf("got %+v", m)
	}
	for _, bad := range []string{"rpm=5", "m rpm=-1", "m rpm=x", "m bogus=1", "m rpm", "m rpm=1 rpm=2", "m rpm=1; m tpm=2", strings.Repeat("x", 201) + " rpm=1"} {
		if _, err := ParseModelLimits(bad); err == nil {
			t.Errorf("ParseModelLimits(%q) accepted", bad)
		}
	}
}

func TestParsePrices(t *testing.T) {
	m, err := ParsePrices("gpt-4.1-mini input=0.40 output=1.60; mine output=12")
	if err != nil || m["gpt-4.1-mini"] != (Price{Input: 0.40, Output: 1.60}) || m["mine"] != (Price{Output: 12}) {
		t.Fatalf("got %+v %v", m, err)
	}
	m, err = ParsePrices("mine input=2 output=10 batch_output=4")
	if err != nil || m["mine"] != (Price{Input: 2, Output: 10, BatchOutput: 4}) || m["mine"].Batch() != (Price{Input: 1, Output: 4}) {
		t.Fatalf("batch prices: got %+v %v", m, err)
	}
	for _, bad := range []string{"m input=-1", "m input=NaN", "m input=Inf", "m cost=1", "m batch_input=-1"} {
		if _, err := ParsePrices(bad); err == nil {
			t.Errorf("ParsePrices(%q) accepted", bad)
		}
	}
}

func FuzzParseModelLimits(f *testing.F) {
	f.Add("gpt rpm=1 tpm=2 concurrency=3; other rpm=4")
	f.Add("; ;= =;")
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseModelLimits(s)
		if err != nil {
			return
		}
		for name, l := range m {
			if checkName("model", name) != nil || l.RPM < 0 || l.TPM < 0 || l.Concurrency < 0 {
				t.Fatalf("accepted %q: %q %+v", s, name, l)
			}
		}
	})
}

// An announcement from Pub/Sub is outside input: anything but a well-formed pause is
// ignored.
func FuzzOnEvent(f *testing.F) {
	f.Add("pause 1764590000000 openai/gpt-4.1")
	f.Add("pause -1 x")
	f.Add("pause 1 \x00")
	f.Fuzz(func(t *testing.T, payload string) {
		l := &Limiter{models: map[string]*modelState{}}
		l.onEvent(payload)
		for k, s := range l.models {
			if checkName("model", k) != nil || s.pauseUntil.Load() <= 0 {
				t.Fatalf("%q made state %q %d", payload, k, s.pauseUntil.Load())
			}
		}
	})
}

func TestOnEventPausesLocally(t *testing.T) {
	l := &Limiter{models: map[string]*modelState{}}
	till := time.Now().Add(time.Minute).UnixMilli()
	l.onEvent("pause " + itoa(till) + " openai/gpt-4.1")
	if d, _ := l.state("openai/gpt-4.1").pausedFor(time.Now()); d < 50*time.Second {
		t.Fatalf("paused for %v, want about a minute", d)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// CostUSD prices by the limiter's table, then the default one; a nil limiter by the
// default one; a model without a price is not priced.
func TestCostUSD(t *testing.T) {
	l := &Limiter{cfg: Config{Prices: map[string]Price{"mine": {Input: 2, Output: 10}}}}
	if usd, ok := l.CostUSD("mine", 1_000_000, 500_000); !ok || usd != 7 {
		t.Errorf("mine: %v %v", usd, ok)
	}
	const def = "gpt-4.1-mini"
	price, ok := DefaultPrices[def]
	if !ok {
		t.Fatalf("%s has no default price", def)
	}
	want := (1000*price.Input + 2000*price.Output) / 1e6
	for _, lim := range []*Limiter{l, nil} {
		if usd, ok := lim.CostUSD(def, 1000, 2000); !ok || usd != want {
			t.Errorf("%s with limiter %v: %v %v, want %v", def, lim != nil, usd, ok, want)
		}
	}
	if usd, ok := l.CostUSD("unknown-model", 10, 10); ok || usd != 0 {
		t.Errorf("unknown model: %v %v", usd, ok)
	}
	for _, lim := range []*Limiter{l, nil} { // a batch call: half the price
		if usd, ok := lim.CostUSD(BatchModel(def), 1000, 2000); !ok || usd != want/2 {
			t.Errorf("%s with limiter %v: %v %v, want %v", BatchModel(def), lim != nil, usd, ok, want/2)
		}
	}
}
