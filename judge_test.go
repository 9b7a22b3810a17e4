package onceflow_test

import (
	"strings"
	"testing"

	"github.com/onceflow/onceflow"
)

// ParseVerdict reads a judge's {"score", "reason"} alone or fenced, and refuses the rest
// with a reason.
func TestParseVerdictReadsAScoreAndRefusesTheRest(t *testing.T) {
	for _, tc := range []struct {
		in    string
		score float64
		want  string // a part of the error; "" for none
	}{
		{`{"score":0.75,"reason":"close"}`, 0.75, ""},
		{"  ```json\n{\"score\": 1, \"reason\": \"same\", \"extra\": true}\n```  ", 1, ""},
		{"```\n{\"score\": 0}\n```", 0, ""},
		{`{"score":"0.5","reason":"a quoted number"}`, 0.5, ""},
		{`{"reason":"no score"}`, 0, `no "score"`},
		{`{"score":1.5}`, 0, "from 0 to 1"},
		{`{"score":-0.1}`, 0, "from 0 to 1"},
		{`{"score":"high"}`, 0, "not a JSON object"},
		{`{"score":0.5} {"score":1}`, 0, "more than one"},
		{`Looks good to me.`, 0, "not a JSON object"},
		{``, 0, "not a JSON object"},
	} {
		v, err := onceflow.ParseVerdict(tc.in)
		if tc.want == "" {
			if err != nil || v.Score != tc.score {
				t.Errorf("%q: %+v, %v; want score %v", tc.in, v, err, tc.score)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %+v, %v; want an error saying %q", tc.in, v, err, tc.want)
		}
	}
	long := `{"score":0.5,"reason":"` + strings.Repeat("é", 1000) + `"}`
	if v, err := onceflow.ParseVerdict(long); err != nil || len(v.Reason) > 503 || !strings.HasSuffix(v.Reason, "...") {
		t.Errorf("a long reason: %d bytes, %v; want it clipped to 500 and marked", len(v.Reason), err)
	}
}

// ParseVerdict takes any text without panicking, and what it accepts scores 0 to 1.
func FuzzParseVerdict(f *testing.F) {
	for _, s := range []string{`{"score":0.5,"reason":"x"}`, "```json\n{\"score\":1}\n```", `{"score":1e309}`, `[]`, `{"score":null}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := onceflow.ParseVerdict(s)
		if err == nil && (v.Score < 0 || v.Score > 1 || len(v.Reason) > 503) {
			t.Fatalf("%q parsed to %+v", s, v)
		}
	})
}
