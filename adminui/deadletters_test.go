package adminui_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

// The dead-letters page lists a queue's dead letters; a replay puts the job back on the
// queue; purges and bulk actions ask first.
func TestDeadLettersReplayAndPurge(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	jobs := adminuitest.DeadLetters(t, e, 4)
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/dead-letters")
	if resp.StatusCode != http.StatusOK {
		t.Fatal(resp.StatusCode)
	}
	for _, j := range jobs {
		if !strings.Contains(page, j) {
			t.Fatalf("job %s not listed", j)
		}
	}
	if !strings.Contains(page, "permanent: unexpected EOF") {
		t.Fatalf("reason not shown: %.500s", page)
	}
	token := adminuitest.CSRF(t, page)
	dl, _, _ := queue.ListDead(ctx, e.Redis, e.Keys, "", 10)
	// The filter finds by job id (or tenant, kind, reason).
	_, page = adminuitest.Get(t, c, e.URL+"/ui/dead-letters?queue="+adminuitest.Queue+"&q="+jobs[2][len(jobs[2])-4:])
	if !strings.Contains(page, jobs[2]) || strings.Contains(page, jobs[0]) || !strings.Contains(page, "1 matching of 4 read") {
		t.Fatalf("filter: %.2000s", page)
	}

	// Replay of one row: at once.
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"replay"}, "id": {dl[0].ID}})
	if resp.StatusCode != http.StatusSeeOther || !strings.Contains(resp.Header.Get("Location"), "done=replay&n=1") {
		t.Fatalf("replay: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	if _, state, _, err := queue.JobState(ctx, e.Redis, e.Keys, dl[0].JobID); err != nil || state != "queued" {
		t.Fatalf("replayed job's state: %q %v", state, err)
	}
	_, page = adminuitest.Get(t, c, e.URL+resp.Header.Get("Location"))
	if !strings.Contains(page, "Replayed 1.") {
		t.Fatalf("no outcome shown: %.500s", page)
	}
	// Purge of one row: asks, then does it.
	purge := url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"purge"}, "id": {dl[1].ID}}
	resp, page = adminuitest.Post(t, c, e.URL+"/ui/dead-letters", purge)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "Are you sure?") || e.Redis.XLen(ctx, e.Keys.Dead()).Val() != 3 {
		t.Fatalf("purge without confirmation: %d, %d left", resp.StatusCode, e.Redis.XLen(ctx, e.Keys.Dead()).Val())
	}
	purge.Set("confirm", "yes")
	if resp, _ = adminuitest.Post(t, c, e.URL+"/ui/dead-letters", purge); resp.StatusCode != http.StatusSeeOther || e.Redis.XLen(ctx, e.Keys.Dead()).Val() != 2 {
		t.Fatalf("confirmed purge: %d", resp.StatusCode)
	}
	// Bulk replay of the rest (all): asks, then replays both.
	all := url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"replay"}, "all": {"1"}}
	if _, page = adminuitest.Post(t, c, e.URL+"/ui/dead-letters", all); !strings.Contains(page, "all 2 dead letters") {
		t.Fatalf("bulk confirmation: %.500s", page)
	}
	all.Set("confirm", "yes")
	if resp, _ = adminuitest.Post(t, c, e.URL+"/ui/dead-letters", all); resp.StatusCode != http.StatusBadRequest || e.Redis.XLen(ctx, e.Keys.Dead()).Val() != 2 {
		t.Fatalf("a confirmed \"all\" without the confirmation page's upto: %d", resp.StatusCode)
	}
	all.Set("upto", regexp.MustCompile(`name="upto" value="([0-9]+-[0-9]+)"`).FindStringSubmatch(page)[1])
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/dead-letters", all)
	if resp.StatusCode != http.StatusSeeOther || e.Redis.XLen(ctx, e.Keys.Dead()).Val() != 0 || e.Redis.XLen(ctx, e.Keys.Stream()).Val() < 3 {
		t.Fatalf("bulk replay: %d, %d dead left", resp.StatusCode, e.Redis.XLen(ctx, e.Keys.Dead()).Val())
	}
	if resp, _ = adminuitest.Get(t, c, e.URL+"/ui/dead-letters?queue=nope"); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("unknown queue: %d", resp.StatusCode)
	}
}

// Oversized forms, too many ids, malformed ids, an unconfigured queue and an unknown
// action are refused (4xx, never 5xx) and nothing is done.
func TestBadDeadLetterFormsAreRefused(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 1)
	dl, _, _ := queue.ListDead(context.Background(), e.Redis, e.Keys, "", 10)
	c, token := signedIn(t, e)
	form := url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"purge"}, "confirm": {"yes"}, "id": {dl[0].ID}}
	big := form.Encode() + "&pad=" + strings.Repeat("x", 300<<10)
	if code, _, _ := try(c, http.MethodPost, e.URL+"/ui/dead-letters", strings.NewReader(big)); code >= 500 || code == http.StatusSeeOther {
		t.Errorf("300 KiB form: %d", code)
	}
	many := url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"purge"}, "confirm": {"yes"}}
	for range 1001 {
		many.Add("id", dl[0].ID)
	}
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", many); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("1001 ids: %d", resp.StatusCode)
	}
	for _, id := range []string{"1-", "-1", "abc", "1-2-3", "+1-0", "1 -0", "(1-0", "0x1-0", "1-0\x00", "99999999999999999999-0"} {
		f := url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"purge"}, "confirm": {"yes"}, "id": {dl[0].ID, id}}
		if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", f); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("id %q: %d", id, resp.StatusCode)
		}
	}
	for _, q := range []string{"nope", adminuitest.Queue + " ", strings.ToUpper(adminuitest.Queue), "../" + adminuitest.Queue} {
		f := url.Values{"csrf": {token}, "queue": {q}, "action": {"purge"}, "confirm": {"yes"}, "all": {"1"}}
		if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", f); resp.StatusCode != http.StatusNotFound {
			t.Errorf("queue %q: %d", q, resp.StatusCode)
		}
	}
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"delete"}, "all": {"1"}, "confirm": {"yes"}}); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("unknown action: %d", resp.StatusCode)
	}
	if n := deadCount(e); n != 1 {
		t.Fatalf("a refused form changed the dead letters: %d left", n)
	}
}

// "Purge all" confirmed for N dead letters purges only what the operator saw: not the
// dead letters that arrived between the confirmation and the click.
func TestPurgeAllPurgesOnlyWhatWasConfirmed(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 1)
	c, token := signedIn(t, e)
	f := url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"purge"}, "all": {"1"}}
	_, page := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", f)
	if !strings.Contains(page, "all 1 dead letters") {
		t.Fatalf("confirmation: %.300s", page)
	}
	f.Set("upto", uptoOf(t, page)) // as the confirmation page's form sends it
	// Two more jobs fail while the operator reads the question.
	ctx := context.Background()
	for i := range 2 {
		if err := e.Redis.XAdd(ctx, &redis.XAddArgs{Stream: e.Keys.Dead(), Values: map[string]any{"job_id": fmt.Sprintf("late-%d", i), "tenant": "acme",
			"reason": "permanent: late", "raw": "{}", "failed_at": strconv.FormatInt(time.Now().UnixMilli(), 10), "deliveries": "1"}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	f.Set("confirm", "yes")
	adminuitest.Post(t, c, e.URL+"/ui/dead-letters", f)
	if n := deadCount(e); n != 2 {
		t.Errorf("confirmed a purge of 1 dead letter; %d of 3 are left, want the 2 the operator never saw", n)
	}
}

// A bulk replay that Redis's crash interrupts midway loses no dead letter (each is
// replayed or still there), and tells the operator that a store failed (503) rather
// than that the rest were malformed messages to purge.
func TestBulkReplayInterruptedByARedisCrashLosesNoDeadLetter(t *testing.T) {
	t.Parallel()
	var buf testenv.SyncBuffer
	e, srv := privateRedisEnv(t, &buf)
	ctx := context.Background()
	jobs := adminuitest.DeadLetters(t, e, 20)
	c, token := signedIn(t, e)
	c.Timeout = 4 * time.Second
	var armed atomic.Bool
	var scripts atomic.Int32
	e.Redis.AddHook(killHook{before: func(cmd redis.Cmder) {
		if armed.Load() && (cmd.Name() == "evalsha" || cmd.Name() == "eval") && scripts.Add(1) == 7 {
			srv.Kill()
		}
	}})
	_, confirm := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"replay"}, "all": {"1"}})
	upto := uptoOf(t, confirm)
	armed.Store(true)
	t0 := time.Now()
	code, h, body := try(c, http.MethodPost, e.URL+"/ui/dead-letters", strings.NewReader(url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"replay"}, "all": {"1"}, "confirm": {"yes"}, "upto": {upto}}.Encode()))
	elapsed := time.Since(t0)
	armed.Store(false)
	loc := ""
	if h != nil {
		loc = h.Get("Location")
	}
	srv.Start()
	var dead, replayed int
	for _, id := range jobs {
		d, err := queue.FindDead(ctx, e.Redis, e.Keys, id)
		if err != nil {
			t.Fatal(err)
		}
		_, state, _, _ := queue.JobState(ctx, e.Redis, e.Keys, id)
		switch {
		case len(d) == 1 && state == "failed":
			dead++
		case len(d) == 0 && state == "queued":
			replayed++
		default:
			t.Errorf("job %s: %d dead letters, state %q: lost or doubled", id, len(d), state)
		}
	}
	t.Logf("interrupted bulk replay: %d %q after %s; %d replayed, %d still dead", code, loc, elapsed, replayed, dead)
	if replayed == 0 || dead == 0 {
		t.Fatalf("the crash did not land midway: %d replayed, %d dead", replayed, dead)
	}
	if code != http.StatusServiceUnavailable {
		t.Errorf("an outage midway answered %d %q (%.100s), want 503: the notice then blames malformed messages and says to purge", code, loc, body)
	}
}

// killHook calls before with each command a Redis client sends.
type killHook struct{ before func(redis.Cmder) }

func (killHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h killHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.before(cmd)
		return next(ctx, cmd)
	}
}

func (killHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// uptoOf returns the newest dead letter a confirmation page of "all" names.
func uptoOf(t *testing.T, page string) string {
	t.Helper()
	m := regexp.MustCompile(`name="upto" value="([0-9]+-[0-9]+)"`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no upto in the confirmation: %.500s", page)
	}
	return m[1]
}
