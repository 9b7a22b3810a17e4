package adminui_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/queue"
)

// A guard from the attack round: A history line's strings (detail, consumer, outcome, entry, dead
// letter id) reach the job page only escaped by html/template: in the trail and in
// the deliveries table, markup in them is text.
func TestAttackHistoryDetailsAreEscapedOnTheJobPage(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	const job = "00000000-0000-4000-8000-00000000a77a"
	if _, err := queue.Enqueue(ctx, e.Redis, e.Keys, queue.Message{JobID: job, Tenant: "acme", Payload: []byte(`{}`), EnqueuedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	const xss = `<script>alert(1)</script><img src=x onerror=alert(2)>"'`
	var lines []string
	for i, outcome := range []string{queue.OutcomeRetry, queue.OutcomeDeadLettered, xss} {
		rec, _ := json.Marshal(map[string]any{"outcome": outcome, "entry": "1-0" + xss, "n": 1, "consumer": xss, "start": time.Now().UnixMilli() - 1000,
			"end": time.Now().UnixMilli(), "detail": xss, "dead": xss, "wait": 10})
		lines = append(lines, string(rune('1'+i))+" "+string(rec))
	}
	if err := e.Redis.HSet(ctx, e.Keys.Job(job), "history", strings.Join(lines, "\n"), "history_n", 3).Err(); err != nil {
		t.Fatal(err)
	}
	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, b, e.URL+"/ui/jobs/"+job)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "<h2>Deliveries</h2>") {
		t.Fatalf("%d %.3000s", resp.StatusCode, page)
	}
	for _, bad := range []string{"<script>alert", "<img src=x"} {
		if strings.Contains(page, bad) {
			i := strings.Index(page, bad)
			t.Errorf("unescaped %q on the job page: %s", bad, page[max(i-200, 0):min(i+200, len(page))])
		}
	}
	if !strings.Contains(page, "&lt;script&gt;alert(1)&lt;/script&gt;") {
		t.Errorf("the hostile detail is not shown escaped")
	}
}
