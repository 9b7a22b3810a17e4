package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
)

func TestLogSenderRedactsSecretLookingFields(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	s := LogSender{Logger: slog.New(slog.NewJSONHandler(&buf, nil))}
	err := s.Send(context.Background(), Message{ID: 7, Topic: "email.summary_ready", DedupeKey: "summary_ready:j1",
		Payload: json.RawMessage(`{"to":"a@example.com","api_key":"sk-live-123","nested":{"Password":"hunter2","ok":1},"list":[{"token":"t0k"}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, secret := range []string{"sk-live-123", "hunter2", "t0k"} {
		if strings.Contains(out, secret) {
			t.Errorf("log line leaks %q: %s", secret, out)
		}
	}
	for _, keep := range []string{"summary_ready:j1", "a@example.com", `\"ok\":1`, "email.summary_ready"} {
		if !strings.Contains(out, keep) {
			t.Errorf("log line lacks %q: %s", keep, out)
		}
	}
	buf.Reset()
	_ = s.Send(context.Background(), Message{Payload: json.RawMessage(`not json`)})
	if !strings.Contains(buf.String(), "unparseable payload") {
		t.Errorf("bad payload logged as %s", buf.String())
	}
}
