package adminui_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/queue"
)

const (
	adminKey  = "admin-key-0123456789abcdef"
	tenantKey = "tenant-key-0123456789abcdef"
	queueName = "uiq"
)

// uiEnv is a UI on a client of its own (a per-test Redis prefix and PostgreSQL schema).
type uiEnv struct {
	url    string // the server's base URL, without /ui/
	rdb    *redis.Client
	client *onceflow.Client
	keys   queue.Keys
}

func newUIEnv(t *testing.T, cfg adminui.Config) *uiEnv {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{queueName: {}}})
	if err != nil {
		t.Fatal(err)
	}
	return serveUI(t, c, rdb, cfg)
}

// serveUI serves a UI of c (another process of the same deployment, when c is shared).
func serveUI(t *testing.T, c *onceflow.Client, rdb *redis.Client, cfg adminui.Config) *uiEnv {
	t.Helper()
	cfg.Client = c
	if cfg.AdminKeys == nil {
		cfg.AdminKeys = []string{adminKey}
	}
	cfg.Logger = testenv.Logger(t)
	ui, err := adminui.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ui/", ui)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &uiEnv{url: srv.URL, rdb: rdb, client: c, keys: c.QueueKeys(queueName)}
}

// browser is a cookie-keeping client that does not follow redirects.
func browser(t *testing.T) *http.Client {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func get(t *testing.T, c *http.Client, u string) (*http.Response, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func post(t *testing.T, c *http.Client, u string, form url.Values, header ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func csrfOf(t *testing.T, html string) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(html)
	if m == nil {
		t.Fatalf("no csrf field in %.300s", html)
	}
	return m[1]
}

// signIn signs c in with key and returns the status of the sign-in POST.
func signIn(t *testing.T, e *uiEnv, c *http.Client, key string) int {
	t.Helper()
	_, form := get(t, c, e.url+"/ui/login")
	resp, _ := post(t, c, e.url+"/ui/login", url.Values{"csrf": {csrfOf(t, form)}, "key": {key}})
	return resp.StatusCode
}

// A sign-in opens every page on every process of the deployment (the session is in
// Redis), sets a cookie that scripts cannot read and other sites cannot send, and
// signing out ends it everywhere.
func TestSignInAndOutAcrossProcesses(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{})
	other := serveUI(t, e.client, e.rdb, adminui.Config{}) // a second process
	c := browser(t)
	if resp, _ := get(t, c, e.url+"/ui/"); resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/login" {
		t.Fatalf("signed out, /ui/ answered %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	_, form := get(t, c, e.url+"/ui/login")
	resp, _ := post(t, c, e.url+"/ui/login", url.Values{"csrf": {csrfOf(t, form)}, "key": {adminKey}})
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
	if strings.Contains(session.Value, adminKey) {
		t.Fatal("the cookie carries the admin key")
	}
	resp, page := get(t, c, e.url+"/ui/")
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "<h1>Overview</h1>") || !strings.Contains(page, queueName) {
		t.Fatalf("overview: %d %.300s", resp.StatusCode, page)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "frame-ancestors 'none'") || resp.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("headers: %v", resp.Header)
	}
	// The other process knows the session.
	oc := browser(t)
	u, _ := url.Parse(other.url + "/ui/")
	oc.Jar.SetCookies(u, []*http.Cookie{{Name: "onceflow_ui", Value: session.Value, Path: "/ui/"}})
	if resp, _ := get(t, oc, other.url+"/ui/"); resp.StatusCode != http.StatusOK {
		t.Fatalf("the other process: %d", resp.StatusCode)
	}
	// Sign out on the first: the session ends on both.
	resp, _ = post(t, c, e.url+"/ui/logout", url.Values{"csrf": {csrfOf(t, page)}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign-out: %d", resp.StatusCode)
	}
	if resp, _ := get(t, oc, other.url+"/ui/"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("after sign-out the other process answered %d", resp.StatusCode)
	}
}

// Tenant API keys, wrong keys and a removed admin key do not open the UI.
func TestOnlyAdminKeysOpenTheUI(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{AdminKeys: []string{adminKey, "second-admin-key-0123456789"}})
	for _, key := range []string{tenantKey, "", adminKey + " ", strings.ToUpper(adminKey)} {
		c := browser(t)
		if code := signIn(t, e, c, key); code != http.StatusUnauthorized {
			t.Errorf("key %q: sign-in answered %d, want 401", key, code)
		}
		if resp, _ := get(t, c, e.url+"/ui/"); resp.StatusCode != http.StatusSeeOther {
			t.Errorf("key %q opened the overview", key)
		}
	}
	// A session opened with a key that a later configuration no longer has ends.
	c := browser(t)
	if code := signIn(t, e, c, "second-admin-key-0123456789"); code != http.StatusSeeOther {
		t.Fatalf("second key: %d", code)
	}
	rotated := serveUI(t, e.client, e.rdb, adminui.Config{AdminKeys: []string{adminKey}})
	var token string
	u, _ := url.Parse(e.url + "/ui/")
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == "onceflow_ui" {
			token = ck.Value
		}
	}
	rc := browser(t)
	ru, _ := url.Parse(rotated.url + "/ui/")
	rc.Jar.SetCookies(ru, []*http.Cookie{{Name: "onceflow_ui", Value: token, Path: "/ui/"}})
	if resp, _ := get(t, rc, rotated.url+"/ui/"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("a session of a removed key was accepted: %d", resp.StatusCode)
	}
}

// Failed sign-ins are counted per address across processes: past the limit even the
// right key is refused with 429 and Retry-After.
func TestSignInAttemptsAreLimited(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{LoginAttempts: 3})
	other := serveUI(t, e.client, e.rdb, adminui.Config{LoginAttempts: 3})
	for i := range 3 {
		target := e
		if i%2 == 1 {
			target = other
		}
		if code := signIn(t, target, browser(t), "wrong-key-0123456789abcdef"); code != http.StatusUnauthorized {
			t.Fatalf("attempt %d: %d", i+1, code)
		}
	}
	c := browser(t)
	_, form := get(t, c, e.url+"/ui/login")
	resp, page := post(t, c, e.url+"/ui/login", url.Values{"csrf": {csrfOf(t, form)}, "key": {adminKey}})
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" || !strings.Contains(page, "Too many") {
		t.Fatalf("after 3 failures the right key got %d (Retry-After %q)", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if n, _ := strconv.Atoi(resp.Header.Get("Retry-After")); n < 1 || n > 60 {
		t.Fatalf("Retry-After %q", resp.Header.Get("Retry-After"))
	}
}

// deadLetters makes n dead letters in e's queue (a worker fails n jobs permanently) and
// returns their job ids.
func deadLetters(t *testing.T, e *uiEnv, n int) []string {
	t.Helper()
	ctx := context.Background()
	var jobs []string
	for i := range n {
		id := "00000000-0000-4000-8000-" + strings.Repeat("0", 12-len(strconv.Itoa(i+1))) + strconv.Itoa(i+1)
		if _, err := queue.Enqueue(ctx, e.rdb, e.keys, queue.Message{JobID: id, Tenant: "acme", Kind: "greeting", Payload: json.RawMessage(`{"name":"x"}`)}); err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, id)
	}
	w, err := queue.NewWorker(queue.WorkerConfig{Redis: e.rdb, Keys: e.keys, Logger: slog.New(slog.DiscardHandler),
		Handler: queue.HandlerFunc(func(context.Context, *queue.Job) error { return queue.Permanent(io.ErrUnexpectedEOF) })})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = w.Run(wctx); close(done) }()
	testenv.WaitFor(t, 10*time.Second, "dead letters", func() bool { return e.rdb.XLen(ctx, e.keys.Dead()).Val() == int64(n) })
	cancel()
	<-done
	return jobs
}

// Every POST needs the session's CSRF token and the UI's own origin: without them it is
// refused with 403 and nothing is done.
func TestPostsWithoutTheSessionsTokenDoNothing(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{})
	deadLetters(t, e, 1)
	dl, _, err := queue.ListDead(context.Background(), e.rdb, e.keys, "", 10)
	if err != nil || len(dl) != 1 {
		t.Fatal(dl, err)
	}
	c := browser(t)
	if code := signIn(t, e, c, adminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, page := get(t, c, e.url+"/ui/dead-letters")
	token := csrfOf(t, page)
	other := browser(t) // another operator's session
	if code := signIn(t, e, other, adminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, otherPage := get(t, other, e.url+"/ui/dead-letters")
	form := func(csrf string) url.Values {
		return url.Values{"csrf": {csrf}, "queue": {queueName}, "action": {"replay"}, "id": {dl[0].ID}}
	}
	for name, try := range map[string]func() *http.Response{
		"no token":    func() *http.Response { r, _ := post(t, c, e.url+"/ui/dead-letters", form("")); return r },
		"wrong token": func() *http.Response { r, _ := post(t, c, e.url+"/ui/dead-letters", form(token+"x")); return r },
		"another's": func() *http.Response {
			r, _ := post(t, c, e.url+"/ui/dead-letters", form(csrfOf(t, otherPage)))
			return r
		},
		"other origin": func() *http.Response {
			r, _ := post(t, c, e.url+"/ui/dead-letters", form(token), "Origin", "https://evil.example")
			return r
		},
		"cross-site": func() *http.Response {
			r, _ := post(t, c, e.url+"/ui/dead-letters", form(token), "Sec-Fetch-Site", "cross-site")
			return r
		},
		"no session": func() *http.Response { r, _ := post(t, browser(t), e.url+"/ui/dead-letters", form(token)); return r },
		"login, no form": func() *http.Response {
			r, _ := post(t, browser(t), e.url+"/ui/login", url.Values{"key": {adminKey}})
			return r
		},
	} {
		if resp := try(); resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, resp.StatusCode)
		}
	}
	if n := e.rdb.XLen(context.Background(), e.keys.Dead()).Val(); n != 1 {
		t.Fatalf("a refused POST changed the dead letters: %d left", n)
	}
	// The same POST with the token and the UI's origin works.
	resp, _ := post(t, c, e.url+"/ui/dead-letters", form(token), "Origin", e.url)
	if resp.StatusCode != http.StatusSeeOther || e.rdb.XLen(context.Background(), e.keys.Dead()).Val() != 0 {
		t.Fatalf("the valid replay: %d", resp.StatusCode)
	}
}

// The dead-letters page lists a queue's dead letters; a replay puts the job back on the
// queue; purges and bulk actions ask first.
func TestDeadLettersReplayAndPurge(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{})
	ctx := context.Background()
	jobs := deadLetters(t, e, 4)
	c := browser(t)
	if code := signIn(t, e, c, adminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	resp, page := get(t, c, e.url+"/ui/dead-letters")
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
	token := csrfOf(t, page)
	dl, _, _ := queue.ListDead(ctx, e.rdb, e.keys, "", 10)
	// The filter finds by job id (or tenant, kind, reason).
	_, page = get(t, c, e.url+"/ui/dead-letters?queue="+queueName+"&q="+jobs[2][len(jobs[2])-4:])
	if !strings.Contains(page, jobs[2]) || strings.Contains(page, jobs[0]) || !strings.Contains(page, "1 matching of 4 read") {
		t.Fatalf("filter: %.2000s", page)
	}

	// Replay of one row: at once.
	resp, _ = post(t, c, e.url+"/ui/dead-letters", url.Values{"csrf": {token}, "queue": {queueName}, "action": {"replay"}, "id": {dl[0].ID}})
	if resp.StatusCode != http.StatusSeeOther || !strings.Contains(resp.Header.Get("Location"), "done=replay&n=1") {
		t.Fatalf("replay: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	if _, state, _, err := queue.JobState(ctx, e.rdb, e.keys, dl[0].JobID); err != nil || state != "queued" {
		t.Fatalf("replayed job's state: %q %v", state, err)
	}
	_, page = get(t, c, e.url+resp.Header.Get("Location"))
	if !strings.Contains(page, "Replayed 1.") {
		t.Fatalf("no outcome shown: %.500s", page)
	}
	// Purge of one row: asks, then does it.
	purge := url.Values{"csrf": {token}, "queue": {queueName}, "action": {"purge"}, "id": {dl[1].ID}}
	resp, page = post(t, c, e.url+"/ui/dead-letters", purge)
	if resp.StatusCode != http.StatusOK || !strings.Contains(page, "Are you sure?") || e.rdb.XLen(ctx, e.keys.Dead()).Val() != 3 {
		t.Fatalf("purge without confirmation: %d, %d left", resp.StatusCode, e.rdb.XLen(ctx, e.keys.Dead()).Val())
	}
	purge.Set("confirm", "yes")
	if resp, _ = post(t, c, e.url+"/ui/dead-letters", purge); resp.StatusCode != http.StatusSeeOther || e.rdb.XLen(ctx, e.keys.Dead()).Val() != 2 {
		t.Fatalf("confirmed purge: %d", resp.StatusCode)
	}
	// Bulk replay of the rest (all): asks, then replays both.
	all := url.Values{"csrf": {token}, "queue": {queueName}, "action": {"replay"}, "all": {"1"}}
	if _, page = post(t, c, e.url+"/ui/dead-letters", all); !strings.Contains(page, "all 2 dead letters") {
		t.Fatalf("bulk confirmation: %.500s", page)
	}
	all.Set("confirm", "yes")
	if resp, _ = post(t, c, e.url+"/ui/dead-letters", all); resp.StatusCode != http.StatusBadRequest || e.rdb.XLen(ctx, e.keys.Dead()).Val() != 2 {
		t.Fatalf("a confirmed \"all\" without the confirmation page's upto: %d", resp.StatusCode)
	}
	all.Set("upto", regexp.MustCompile(`name="upto" value="([0-9]+-[0-9]+)"`).FindStringSubmatch(page)[1])
	resp, _ = post(t, c, e.url+"/ui/dead-letters", all)
	if resp.StatusCode != http.StatusSeeOther || e.rdb.XLen(ctx, e.keys.Dead()).Val() != 0 || e.rdb.XLen(ctx, e.keys.Stream()).Val() < 3 {
		t.Fatalf("bulk replay: %d, %d dead left", resp.StatusCode, e.rdb.XLen(ctx, e.keys.Dead()).Val())
	}
	if resp, _ = get(t, c, e.url+"/ui/dead-letters?queue=nope"); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("unknown queue: %d", resp.StatusCode)
	}
}

// A successful sign-in gives its attempt back: an operator who signs in, out and in
// again is not counted against the limit like a guesser.
func TestSuccessfulSignInsDoNotSpendTheLimit(t *testing.T) {
	t.Parallel()
	e := newUIEnv(t, adminui.Config{LoginAttempts: 2})
	for i := range 4 {
		if code := signIn(t, e, browser(t), adminKey); code != http.StatusSeeOther {
			t.Fatalf("sign-in %d with the right key: %d", i+1, code)
		}
	}
	if code := signIn(t, e, browser(t), "wrong-key-0123456789abcdef"); code != http.StatusUnauthorized {
		t.Fatalf("the first wrong key after 4 sign-ins: %d, want 401", code)
	}
}
