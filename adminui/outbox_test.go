package adminui_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
)

// The outbox page lists failing and exhausted rows with their last error; a retry makes
// an exhausted row due again (one at once, several after a confirmation).
func TestOutboxRetry(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	db := e.Client.Inspector().DB()
	ids := adminuitest.OutboxRows(t, db, 5, 3)
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/outbox?state=exhausted")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "550 mailbox unavailable") || strings.Contains(page, "connection reset") ||
		!strings.Contains(page, "1 unsent") || !strings.Contains(page, "3 exhausted") || !strings.Contains(page, "1 sent") {
		t.Fatalf("exhausted rows: %d %.3000s", resp.StatusCode, page)
	}
	if _, failing := adminuitest.Get(t, c, e.URL+"/ui/outbox?state=failing"); !strings.Contains(failing, "connection reset") || strings.Contains(failing, "550 mailbox") {
		t.Fatalf("failing rows: %.3000s", failing)
	}
	if resp, _ := adminuitest.Get(t, c, e.URL+"/ui/outbox?state=bogus"); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("unknown state: %d", resp.StatusCode)
	}
	token := adminuitest.CSRF(t, page)
	state := func(id int64) string {
		var s string
		if err := db.QueryRow(context.Background(), `SELECT CASE WHEN exhausted_at IS NOT NULL THEN 'exhausted' ELSE 'due' END FROM outbox WHERE id = $1`, id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/outbox", url.Values{"csrf": {token}, "action": {"retry"}, "id": {strconv.FormatInt(ids[0], 10)}})
	if resp.StatusCode != http.StatusSeeOther || state(ids[0]) != "due" || state(ids[1]) != "exhausted" {
		t.Fatalf("retry of one row: %d %s %s", resp.StatusCode, state(ids[0]), state(ids[1]))
	}
	bulk := url.Values{"csrf": {token}, "action": {"retry"}, "id": {strconv.FormatInt(ids[1], 10), strconv.FormatInt(ids[2], 10)}}
	if _, page = adminuitest.Post(t, c, e.URL+"/ui/outbox", bulk); !strings.Contains(page, "Are you sure?") || state(ids[1]) != "exhausted" {
		t.Fatalf("bulk retry without confirmation: %.2000s", page)
	}
	bulk.Set("confirm", "yes")
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/outbox", bulk)
	if resp.StatusCode != http.StatusSeeOther || state(ids[1]) != "due" || state(ids[2]) != "due" {
		t.Fatalf("confirmed bulk retry: %d", resp.StatusCode)
	}
	// Without the token nothing happens.
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/outbox", url.Values{"action": {"retry"}, "all": {"1"}, "confirm": {"yes"}}); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("retry without a token: %d", resp.StatusCode)
	}
}

// Malformed row ids and too many of them are refused (400) and no row is retried.
func TestBadOutboxFormsAreRefused(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.OutboxRows(t, e.Client.Inspector().DB(), 2, 1)
	c, token := signedIn(t, e)
	for _, id := range []string{"0", "-1", "1e3", "0x10", "9223372036854775808", ""} {
		f := url.Values{"csrf": {token}, "action": {"retry"}, "confirm": {"yes"}, "id": {id}}
		if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/outbox", f); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("outbox id %q: %d", id, resp.StatusCode)
		}
	}
	manyRows := url.Values{"csrf": {token}, "action": {"retry"}, "confirm": {"yes"}}
	for i := range 1001 {
		manyRows.Add("id", strconv.Itoa(i+1))
	}
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/outbox", manyRows); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("1001 outbox ids: %d", resp.StatusCode)
	}
	var exhausted int
	_ = e.Client.Inspector().DB().QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`).Scan(&exhausted)
	if exhausted != 1 {
		t.Fatalf("a refused outbox form retried rows: %d exhausted left", exhausted)
	}
}
