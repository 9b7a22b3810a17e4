package outbox

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
)

// LogSender is a Sender that only logs each message, for development and demos. Values
// under keys that look secret (password, token, secret, key, authorization) are logged
// as "[redacted]". It never fails. The zero value logs to slog.Default().
type LogSender struct {
	// Logger receives one Info line per message. Default: slog.Default().
	Logger *slog.Logger
}

var _ Sender = LogSender{}

// Send logs m and returns nil.
func (s LogSender) Send(ctx context.Context, m Message) error {
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	log.InfoContext(ctx, "outbox message", append(logAttrs(m), "attempts", m.Attempts, "payload", redactPayload(m.Payload))...)
	return nil
}

// redactPayload returns the payload as a JSON string with secret-looking values
// replaced; a payload that is not JSON is shown by size only.
func redactPayload(p json.RawMessage) string {
	var v any
	if err := json.Unmarshal(p, &v); err != nil {
		return "[unparseable payload]"
	}
	b, err := json.Marshal(redactValue(v))
	if err != nil {
		return "[unprintable payload]"
	}
	return string(b)
}

func redactValue(v any) any {
	switch t := v.(type) {
	case map[string]any:
		for k, x := range t {
			if secretKey(k) {
				t[k] = "[redacted]"
			} else {
				t[k] = redactValue(x)
			}
		}
	case []any:
		for i, x := range t {
			t[i] = redactValue(x)
		}
	}
	return v
}

func secretKey(k string) bool {
	k = strings.ToLower(k)
	for _, s := range []string{"password", "passwd", "secret", "token", "authorization", "api_key", "apikey", "credential"} {
		if strings.Contains(k, s) {
			return true
		}
	}
	return k == "key" || strings.HasSuffix(k, "_key") && k != "dedupe_key" && k != "idempotency_key"
}
