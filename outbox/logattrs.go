package outbox

import (
	"encoding/json"
	"unicode/utf8"
)

// logAttrs returns the log attributes that name m's row and, when its payload is a JSON
// object with string fields job_id and tenant (as the summaries workflow writes them),
// the job it belongs to, so that every log line about a job carries job_id and tenant.
func logAttrs(m Message) []any {
	attrs := []any{"id", m.ID, "topic", m.Topic, "dedupe_key", clipLog(m.DedupeKey)}
	var ref struct {
		JobID  json.RawMessage `json:"job_id"`
		Tenant json.RawMessage `json:"tenant"`
	}
	if json.Unmarshal(m.Payload, &ref) != nil {
		return attrs
	}
	var s string
	if json.Unmarshal(ref.JobID, &s) == nil && s != "" {
		attrs = append(attrs, "job_id", clipLog(s))
	}
	s = ""
	if json.Unmarshal(ref.Tenant, &s) == nil && s != "" {
		attrs = append(attrs, "tenant", clipLog(s))
	}
	return attrs
}

// clipLog shortens a value that comes from a row, so one row cannot make a huge line.
func clipLog(s string) string {
	const max = 128
	if len(s) <= max {
		return s
	}
	for i := max; i > 0; i-- {
		if utf8.RuneStart(s[i]) {
			return s[:i] + "…"
		}
	}
	return ""
}
