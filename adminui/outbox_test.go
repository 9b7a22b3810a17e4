package adminui_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

// outboxRows writes n outbox rows, and has the relay's store give up on the first
// exhausted of them (a permanent failure) and fail the next once (retried later);
// it returns the rows' ids in order.
func outboxRows(t *testing.T, db *pgxpool.Pool, n, exhausted int) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	for i := range n {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		id, err := pgoutbox.Insert(ctx, tx, outbox.Message{Topic: "email.summary_ready", DedupeKey: "ui-test-" + strconv.Itoa(i), Payload: []byte(`{"to":"a@example.com"}`)})
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	st := pgoutbox.New(db)
	claimed, err := st.Claim(ctx, "ui-test", n, time.Minute)
	if err != nil || len(claimed) != n {
		t.Fatalf("claim: %d %v", len(claimed), err)
	}
	var s outbox.Settlement
	for i, id := range ids {
		switch {
		case i < exhausted:
			s.Failed = append(s.Failed, outbox.Failure{ID: id, Error: "550 mailbox unavailable", Exhaust: true})
		case i == exhausted:
			s.Failed = append(s.Failed, outbox.Failure{ID: id, Error: "connection reset", Delay: time.Hour})
		default:
			s.Sent = append(s.Sent, id)
		}
	}
	if _, err := st.Settle(ctx, "ui-test", s); err != nil {
		t.Fatal(err)
	}
	return ids
}

// The outbox page lists failing and exhausted rows with their last error; a retry makes
// an exhausted row due again (one at once, several after a confirmation).
func TestOutboxRetry(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{})
	db := e.client.DB()
	ids := outboxRows(t, db, 5, 3)
	c := browser(t)
	if code := signIn(t, e, c, adminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := get(t, c, e.url+"/ui/outbox?state=exhausted")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "550 mailbox unavailable") || strings.Contains(page, "connection reset") ||
		!strings.Contains(page, "1 unsent") || !strings.Contains(page, "3 exhausted") || !strings.Contains(page, "1 sent") {
		t.Fatalf("exhausted rows: %d %.3000s", resp.StatusCode, page)
	}
	if _, failing := get(t, c, e.url+"/ui/outbox?state=failing"); !strings.Contains(failing, "connection reset") || strings.Contains(failing, "550 mailbox") {
		t.Fatalf("failing rows: %.3000s", failing)
	}
	if resp, _ := get(t, c, e.url+"/ui/outbox?state=bogus"); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("unknown state: %d", resp.StatusCode)
	}
	token := csrfOf(t, page)
	state := func(id int64) string {
		var s string
		if err := db.QueryRow(context.Background(), `SELECT CASE WHEN exhausted_at IS NOT NULL THEN 'exhausted' ELSE 'due' END FROM outbox WHERE id = $1`, id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	resp, _ = post(t, c, e.url+"/ui/outbox", url.Values{"csrf": {token}, "action": {"retry"}, "id": {strconv.FormatInt(ids[0], 10)}})
	if resp.StatusCode != http.StatusSeeOther || state(ids[0]) != "due" || state(ids[1]) != "exhausted" {
		t.Fatalf("retry of one row: %d %s %s", resp.StatusCode, state(ids[0]), state(ids[1]))
	}
	bulk := url.Values{"csrf": {token}, "action": {"retry"}, "id": {strconv.FormatInt(ids[1], 10), strconv.FormatInt(ids[2], 10)}}
	if _, page = post(t, c, e.url+"/ui/outbox", bulk); !strings.Contains(page, "Are you sure?") || state(ids[1]) != "exhausted" {
		t.Fatalf("bulk retry without confirmation: %.2000s", page)
	}
	bulk.Set("confirm", "yes")
	resp, _ = post(t, c, e.url+"/ui/outbox", bulk)
	if resp.StatusCode != http.StatusSeeOther || state(ids[1]) != "due" || state(ids[2]) != "due" {
		t.Fatalf("confirmed bulk retry: %d", resp.StatusCode)
	}
	// Without the token nothing happens.
	if resp, _ := post(t, c, e.url+"/ui/outbox", url.Values{"action": {"retry"}, "all": {"1"}, "confirm": {"yes"}}); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("retry without a token: %d", resp.StatusCode)
	}
}
