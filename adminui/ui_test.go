package adminui_test

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/queue"
)

// A sign-in opens every page on every process of the deployment (the session is in
// Redis), sets a cookie that scripts cannot read and other sites cannot send, and
// signing out ends it everywhere.
func TestSignInAndOutAcrossProcesses(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	other := adminuitest.Serve(t, e.Client, e.Redis, adminui.Config{}) // a second process
	c := adminuitest.Browser(t)
	if resp, _ := adminuitest.Get(t, c, e.URL+"/ui/"); resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/login" {
		t.Fatalf("signed out, /ui/ answered %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	_, form := adminuitest.Get(t, c, e.URL+"/ui/login")
	resp, _ := adminuitest.Post(t, c, e.URL+"/ui/login", url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {adminuitest.AdminKey}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign-in: %d", resp.StatusCode)
	}
	var session *http.Cookie
	for _, ck := range resp.Cookies() {
		if ck.Name == "onceflow_ui" && ck.Value != "" {
			session = ck
		}
	}
	if session == nil || !session.HttpOnly || session.SameSite != http.SameSiteStrictMode || session.Path != "/ui/" || session.Secure {
		t.Fatalf("session cookie: %+v", session)
	}
	if strings.Contains(session.Value, adminuitest.AdminKey) {
		t.Fatal("the cookie carries the admin key")
	}
	resp, page := adminuitest.Get(t, c, e.URL+"/ui/")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "<h1>Overview</h1>") || !strings.Contains(page, adminuitest.Queue) {
		t.Fatalf("overview: %d %.300s", resp.StatusCode, page)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "frame-ancestors 'none'") || resp.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("headers: %v", resp.Header)
	}
	// The other process knows the session.
	oc := adminuitest.Browser(t)
	u, _ := url.Parse(other.URL + "/ui/")
	oc.Jar.SetCookies(u, []*http.Cookie{{Name: "onceflow_ui", Value: session.Value, Path: "/ui/"}})
	if resp, _ := adminuitest.Get(t, oc, other.URL+"/ui/"); resp.StatusCode != http.StatusOK {
		t.Fatalf("the other process: %d", resp.StatusCode)
	}
	// Sign out on the first: the session ends on both.
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/logout", url.Values{"csrf": {adminuitest.CSRF(t, page)}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign-out: %d", resp.StatusCode)
	}
	if resp, _ := adminuitest.Get(t, oc, other.URL+"/ui/"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("after sign-out the other process answered %d", resp.StatusCode)
	}
}

// Tenant API keys, wrong keys and a removed admin key do not open the UI.
func TestOnlyAdminKeysOpenTheUI(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{AdminKeys: []string{adminuitest.AdminKey, "second-admin-key-0123456789"}})
	for _, key := range []string{adminuitest.TenantKey, "", adminuitest.AdminKey + " ", strings.ToUpper(adminuitest.AdminKey)} {
		c := adminuitest.Browser(t)
		if code := adminuitest.SignIn(t, e, c, key); code != http.StatusUnauthorized {
			t.Errorf("key %q: sign-in answered %d, want 401", key, code)
		}
		if resp, _ := adminuitest.Get(t, c, e.URL+"/ui/"); resp.StatusCode != http.StatusSeeOther {
			t.Errorf("key %q opened the overview", key)
		}
	}
	// A session opened with a key that a later configuration no longer has ends.
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, "second-admin-key-0123456789"); code != http.StatusSeeOther {
		t.Fatalf("second key: %d", code)
	}
	rotated := adminuitest.Serve(t, e.Client, e.Redis, adminui.Config{AdminKeys: []string{adminuitest.AdminKey}})
	var token string
	u, _ := url.Parse(e.URL + "/ui/")
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == "onceflow_ui" {
			token = ck.Value
		}
	}
	rc := adminuitest.Browser(t)
	ru, _ := url.Parse(rotated.URL + "/ui/")
	rc.Jar.SetCookies(ru, []*http.Cookie{{Name: "onceflow_ui", Value: token, Path: "/ui/"}})
	if resp, _ := adminuitest.Get(t, rc, rotated.URL+"/ui/"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("a session of a removed key was accepted: %d", resp.StatusCode)
	}
}

// Failed sign-ins are counted per address across processes: past the limit even the
// right key is refused with 429 and Retry-After.
func TestSignInAttemptsAreLimited(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{LoginAttempts: 3})
	other := adminuitest.Serve(t, e.Client, e.Redis, adminui.Config{LoginAttempts: 3})
	for i := range 3 {
		target := e
		if i%2 == 1 {
			target = other
		}
		if code := adminuitest.SignIn(t, target, adminuitest.Browser(t), "wrong-key-0123456789abcdef"); code != http.StatusUnauthorized {
			t.Fatalf("attempt %d: %d", i+1, code)
		}
	}
	c := adminuitest.Browser(t)
	_, form := adminuitest.Get(t, c, e.URL+"/ui/login")
	resp, page := adminuitest.Post(t, c, e.URL+"/ui/login", url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {adminuitest.AdminKey}})
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" || !strings.Contains(page, "Too many") {
		t.Fatalf("after 3 failures the right key got %d (Retry-After %q)", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if n, _ := strconv.Atoi(resp.Header.Get("Retry-After")); n < 1 || n > 60 {
		t.Fatalf("Retry-After %q", resp.Header.Get("Retry-After"))
	}
}

// Every POST needs the session's CSRF token and the UI's own origin: without them it is
// refused with 403 and nothing is done.
func TestPostsWithoutTheSessionsTokenDoNothing(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 1)
	dl, _, err := queue.ListDead(context.Background(), e.Redis, e.Keys, "", 10)
	if err != nil || len(dl) != 1 {
		t.Fatal(dl, err)
	}
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, page := adminuitest.Get(t, c, e.URL+"/ui/dead-letters")
	token := adminuitest.CSRF(t, page)
	other := adminuitest.Browser(t) // another operator's session
	if code := adminuitest.SignIn(t, e, other, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, otherPage := adminuitest.Get(t, other, e.URL+"/ui/dead-letters")
	form := func(csrf string) url.Values {
		return url.Values{"csrf": {csrf}, "queue": {adminuitest.Queue}, "action": {"replay"}, "id": {dl[0].ID}}
	}
	for name, try := range map[string]func() *http.Response{
		"no token": func() *http.Response { r, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", form("")); return r },
		"wrong token": func() *http.Response {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", form(token+"x"))
			return r
		},
		"another's": func() *http.Response {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", form(adminuitest.CSRF(t, otherPage)))
			return r
		},
		"other origin": func() *http.Response {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", form(token), "Origin", "https://evil.example")
			return r
		},
		"cross-site": func() *http.Response {
			r, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", form(token), "Sec-Fetch-Site", "cross-site")
			return r
		},
		"no session": func() *http.Response {
			r, _ := adminuitest.Post(t, adminuitest.Browser(t), e.URL+"/ui/dead-letters", form(token))
			return r
		},
		"login, no form": func() *http.Response {
			r, _ := adminuitest.Post(t, adminuitest.Browser(t), e.URL+"/ui/login", url.Values{"key": {adminuitest.AdminKey}})
			return r
		},
	} {
		if resp := try(); resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, resp.StatusCode)
		}
	}
	if n := e.Redis.XLen(context.Background(), e.Keys.Dead()).Val(); n != 1 {
		t.Fatalf("a refused POST changed the dead letters: %d left", n)
	}
	// The same POST with the token and the UI's origin works.
	resp, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", form(token), "Origin", e.URL)
	if resp.StatusCode != http.StatusSeeOther || e.Redis.XLen(context.Background(), e.Keys.Dead()).Val() != 0 {
		t.Fatalf("the valid replay: %d", resp.StatusCode)
	}
}

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

// A successful sign-in gives its attempt back: an operator who signs in, out and in
// again is not counted against the limit like a guesser.
func TestSuccessfulSignInsDoNotSpendTheLimit(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{LoginAttempts: 2})
	for i := range 4 {
		if code := adminuitest.SignIn(t, e, adminuitest.Browser(t), adminuitest.AdminKey); code != http.StatusSeeOther {
			t.Fatalf("sign-in %d with the right key: %d", i+1, code)
		}
	}
	if code := adminuitest.SignIn(t, e, adminuitest.Browser(t), "wrong-key-0123456789abcdef"); code != http.StatusUnauthorized {
		t.Fatalf("the first wrong key after 4 sign-ins: %d, want 401", code)
	}
}
