package adminui_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
)

// ---- helpers of this file ----

// serveLogged is adminuitest.Serve with the UI's log captured in buf as well.
func serveLogged(t *testing.T, c *onceflow.Client, rdb *redis.Client, cfg adminui.Config, buf *testenv.SyncBuffer) *adminuitest.Env {
	t.Helper()
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(buf, testWriter{t}), &slog.HandlerOptions{Level: slog.LevelDebug}))
	return adminuitest.Serve(t, c, rdb, cfg)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func cookieOf(t *testing.T, c *http.Client, base, name string) string {
	t.Helper()
	u, _ := url.Parse(base + "/ui/")
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == name {
			return ck.Value
		}
	}
	return ""
}

// try is post/get that tolerates a transport error (a server that closes an oversized
// request's connection); status 0 then.
func try(c *http.Client, method, u string, body io.Reader, header ...string) (int, http.Header, string) {
	req, _ := http.NewRequest(method, u, body)
	if body != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

func signedIn(t *testing.T, e *adminuitest.Env) (*http.Client, string) {
	t.Helper()
	c := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatalf("sign-in: %d", code)
	}
	_, page := adminuitest.Get(t, c, e.URL+"/ui/dead-letters")
	return c, adminuitest.CSRF(t, page)
}

func deadCount(e *adminuitest.Env) int64 {
	return e.Redis.XLen(context.Background(), e.Keys.Dead()).Val()
}

// privateRedisEnv is a UI whose client's Redis is a server of the test's own (so that
// the test can stop it), through connect.Redis as `onceflow serve` makes it.
func privateRedisEnv(t *testing.T, buf *testenv.SyncBuffer) (*adminuitest.Env, *testenv.Server) {
	t.Helper()
	srv := testenv.PrivateRedis(t)
	rdb, err := connect.Redis(testenv.RedisURLOf(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	pool, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: "att17", Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	return serveLogged(t, c, rdb, adminui.Config{}, buf), srv
}

// ---- 1. as an attacker ----

// Only the exact admin key opens the UI: not a tenant key, nor the key with whitespace,
// in another case, with a NUL or non-ASCII byte, nor a very long key; none sets a session.
func TestAttackCredentialVariants(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{LoginAttempts: 100})
	for _, key := range []string{adminuitest.TenantKey, " " + adminuitest.AdminKey, adminuitest.AdminKey + "\t", adminuitest.AdminKey + "\n", strings.ToUpper(adminuitest.AdminKey),
		adminuitest.AdminKey + "\x00", "\x00" + adminuitest.AdminKey, adminuitest.AdminKey[:len(adminuitest.AdminKey)-1] + "é", adminuitest.AdminKey + "é", strings.Repeat(adminuitest.AdminKey, 4000), strings.Repeat("a", 16)} {
		c := adminuitest.Browser(t)
		if code := adminuitest.SignIn(t, e, c, key); code != http.StatusUnauthorized {
			t.Errorf("key %.40q (len %d): sign-in answered %d, want 401", key, len(key), code)
		}
		if cookieOf(t, c, e.URL, "onceflow_ui") != "" {
			t.Errorf("key %.40q: a session cookie was set", key)
		}
	}
	// A key past the form limit is refused without a 5xx.
	c := adminuitest.Browser(t)
	_, form := adminuitest.Get(t, c, e.URL+"/ui/login")
	body := url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {strings.Repeat("k", 300<<10)}}.Encode()
	if code, _, _ := try(c, http.MethodPost, e.URL+"/ui/login", strings.NewReader(body)); code >= 500 || code == http.StatusSeeOther {
		t.Errorf("300 KiB key: %d", code)
	}
}

// A cookie value an attacker chose never becomes a session: sign-in issues a fresh token.
func TestAttackSessionFixation(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	chosen := strings.Repeat("A", 43)
	c := adminuitest.Browser(t)
	u, _ := url.Parse(e.URL + "/ui/")
	c.Jar.SetCookies(u, []*http.Cookie{{Name: "onceflow_ui", Value: chosen, Path: "/ui/"}})
	if resp, _ := adminuitest.Get(t, c, e.URL+"/ui/"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("a chosen cookie opened the overview: %d", resp.StatusCode)
	}
	if code := adminuitest.SignIn(t, e, c, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	got := cookieOf(t, c, e.URL, "onceflow_ui")
	if got == chosen || got == "" {
		t.Fatalf("session token after sign-in: %q", got)
	}
	fix := adminuitest.Browser(t)
	fix.Jar.SetCookies(u, []*http.Cookie{{Name: "onceflow_ui", Value: chosen, Path: "/ui/"}})
	if resp, _ := adminuitest.Get(t, fix, e.URL+"/ui/"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("the attacker's chosen cookie became a session: %d", resp.StatusCode)
	}
	sum := sha256.Sum256([]byte(chosen))
	if n, _ := e.Redis.Keys(context.Background(), "*"+hex.EncodeToString(sum[:])+"*").Result(); len(n) != 0 {
		t.Fatalf("a session was stored for the chosen token: %v", n)
	}
}

// CSRF: a token of an ended session, a token in the query, state-changing GETs, method
// overrides, Sec-Fetch-Site same-site/cross-site without Origin and Origin "null" from
// another site are all refused, and nothing is done.
func TestAttackCSRFVariants(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 1)
	dl, _, _ := queue.ListDead(context.Background(), e.Redis, e.Keys, "", 10)
	c, old := signedIn(t, e)
	if resp, _ := adminuitest.Post(t, c, e.URL+"/ui/logout", url.Values{"csrf": {old}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatal(resp.StatusCode)
	}
	c2 := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, c2, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, page := adminuitest.Get(t, c2, e.URL+"/ui/dead-letters")
	token := adminuitest.CSRF(t, page)
	if token == old {
		t.Fatal("a new session reuses the old CSRF token")
	}
	form := func(csrf string) url.Values {
		return url.Values{"csrf": {csrf}, "queue": {adminuitest.Queue}, "action": {"replay"}, "id": {dl[0].ID}}
	}
	cases := map[string]func() int{
		"token after sign-out": func() int { r, _ := adminuitest.Post(t, c2, e.URL+"/ui/dead-letters", form(old)); return r.StatusCode },
		"token in the query only": func() int {
			f := form("")
			f.Del("csrf")
			r, _ := adminuitest.Post(t, c2, e.URL+"/ui/dead-letters?csrf="+url.QueryEscape(token), f)
			return r.StatusCode
		},
		"same-site, no Origin": func() int {
			r, _ := adminuitest.Post(t, c2, e.URL+"/ui/dead-letters", form(token), "Sec-Fetch-Site", "same-site")
			return r.StatusCode
		},
		"Origin null, cross-site": func() int {
			r, _ := adminuitest.Post(t, c2, e.URL+"/ui/dead-letters", form(token), "Origin", "null", "Sec-Fetch-Site", "cross-site")
			return r.StatusCode
		},
		"Origin null, same-site": func() int {
			r, _ := adminuitest.Post(t, c2, e.URL+"/ui/dead-letters", form(token), "Origin", "null", "Sec-Fetch-Site", "same-site")
			return r.StatusCode
		},
		"override header, no token": func() int {
			r, _ := adminuitest.Post(t, c2, e.URL+"/ui/dead-letters", form(""), "X-HTTP-Method-Override", "GET")
			return r.StatusCode
		},
		"login from another origin": func() int {
			_, f := adminuitest.Get(t, adminuitest.Browser(t), e.URL+"/ui/login")
			_ = f
			lc := adminuitest.Browser(t)
			_, lf := adminuitest.Get(t, lc, e.URL+"/ui/login")
			r, _ := adminuitest.Post(t, lc, e.URL+"/ui/login", url.Values{"csrf": {adminuitest.CSRF(t, lf)}, "key": {adminuitest.AdminKey}}, "Origin", "https://evil.example")
			return r.StatusCode
		},
	}
	for name, do := range cases {
		if code := do(); code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, code)
		}
	}
	// GETs never change state: the action's fields in a GET, GET /ui/logout (405), and a
	// GET with a method-override header.
	q := form(token)
	q.Set("confirm", "yes")
	if resp, _ := adminuitest.Get(t, c2, e.URL+"/ui/dead-letters?"+q.Encode()); resp.StatusCode != http.StatusOK {
		t.Errorf("GET with action fields: %d", resp.StatusCode)
	}
	code, _, _ := try(c2, http.MethodGet, e.URL+"/ui/logout", nil, "X-HTTP-Method-Override", "POST")
	if code != http.StatusMethodNotAllowed {
		t.Errorf("GET /ui/logout: %d, want 405", code)
	}
	if resp, _ := adminuitest.Get(t, c2, e.URL+"/ui/"); resp.StatusCode != http.StatusOK {
		t.Errorf("the session ended after a GET /ui/logout: %d", resp.StatusCode)
	}
	if n := deadCount(e); n != 1 {
		t.Fatalf("a refused request changed the dead letters: %d left", n)
	}
}

const xss = `"'><b>XSS</b><script>alert(1)</script>`

// Every stored field and every echoed input is escaped on every page.
func TestAttackStoredAndReflectedXSS(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	// A dead letter whose every field is hostile (a malformed record, as a buggy or
	// hostile producer leaves), and one whose job id is a javascript: URL.
	for _, id := range []string{xss, "javascript:alert(1)"} {
		if err := e.Redis.XAdd(ctx, &redis.XAddArgs{Stream: e.Keys.Dead(), Values: map[string]any{
			"job_id": id, "tenant": xss, "kind": xss, "reason": "malformed: " + xss, "raw": `{"x":"` + `<b>XSS</b>` + `"}`,
			"failed_at": strconv.FormatInt(time.Now().UnixMilli(), 10), "deliveries": "1"}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	db := e.Client.Inspector().DB()
	if _, err := db.Exec(ctx, `INSERT INTO outbox (topic, dedupe_key, payload, attempts, last_error, exhausted_at) VALUES ($1, $2, '{}', 3, $1, now())`,
		xss, xss+"-"+xss); err != nil {
		t.Fatal(err)
	}
	l, err := ledger.New(db, ledger.Config{Wait: -1})
	if err != nil {
		t.Fatal(err)
	}
	if a, _, err := l.Begin(ctx, ledger.Call{Key: "k-xss", Work: xss + "/" + xss, RequestHash: "h", Provider: "openai", Model: xss}); err != nil {
		t.Logf("ledger refused a hostile row (fine): %v", err)
	} else if err := a.Fail(ctx, errors.New(xss), false); err != nil {
		t.Fatal(err)
	}
	c, _ := signedIn(t, e)
	pages := []string{
		"/ui/", "/ui/dead-letters", "/ui/dead-letters?q=" + url.QueryEscape(xss), "/ui/dead-letters?q=" + url.QueryEscape("<b>XSS"),
		"/ui/dead-letters?done=" + url.QueryEscape(xss) + "&n=" + url.QueryEscape(xss) + "&gone=" + url.QueryEscape(xss),
		"/ui/dead-letters?done=replay&n=" + url.QueryEscape(xss) + "&failed=" + url.QueryEscape(xss),
		"/ui/outbox?state=all", "/ui/outbox?state=exhausted&topic=" + url.QueryEscape(xss),
		"/ui/outbox?done=retry&n=" + url.QueryEscape(xss),
		"/ui/calls", "/ui/calls?model=" + url.QueryEscape(xss) + "&job=" + url.QueryEscape(xss),
		"/ui/jobs/" + url.PathEscape(xss), "/ui/jobs/" + url.PathEscape("javascript:alert(1)"),
		"/ui/jobs?q=" + url.QueryEscape(xss), "/ui/jobs?key=k&path=" + url.QueryEscape(xss) + "&tenant=" + url.QueryEscape(xss),
		"/ui/dead-letters?queue=" + url.QueryEscape(xss), "/ui/outbox?state=" + url.QueryEscape(xss), "/ui/calls?state=" + url.QueryEscape(xss),
	}
	seen := 0
	for _, p := range pages {
		resp, page := adminuitest.Get(t, c, e.URL+p)
		if resp.StatusCode >= 500 {
			t.Errorf("%s: %d", p, resp.StatusCode)
		}
		if loc := resp.Header.Get("Location"); loc != "" && !strings.HasPrefix(loc, "/ui/") {
			t.Errorf("%s redirected to %q", p, loc)
		}
		for _, bad := range []string{"<b>XSS", "<script>alert", `href="javascript:`, `'><`} {
			if strings.Contains(page, bad) {
				t.Errorf("%s renders %q unescaped", p, bad)
			}
		}
		if strings.Contains(page, "&lt;b&gt;XSS") {
			seen++
		} else if p == "/ui/dead-letters" || p == "/ui/outbox?state=all" || p == "/ui/calls" || p == "/ui/jobs/"+url.PathEscape(xss) {
			t.Errorf("%s does not show the stored hostile value (escaped): the test did not reach it", p)
		}
	}
	if seen < 6 {
		t.Fatalf("the hostile values were rendered (escaped) on only %d pages: the test did not reach them", seen)
	}
	_, page := adminuitest.Get(t, c, e.URL+"/ui/dead-letters?done=replay&n=-7&gone=x&failed=-1")
	if !strings.Contains(page, "Replayed 0.") {
		t.Errorf("a negative n is not clamped: %.300s", page)
	}
}

// The job search redirects only into the UI, whatever the id, dedupe key or
// idempotency key and path.
func TestAttackSearchOpenRedirect(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	ctx := context.Background()
	// An effect whose dedupe key is a redirect and embeds no job.
	if _, err := e.Client.Inspector().DB().Exec(ctx, `INSERT INTO outbox (topic, dedupe_key, payload) VALUES ('t', '//evil.example', '{}')`); err != nil {
		t.Fatal(err)
	}
	c, _ := signedIn(t, e)
	base, _ := url.Parse(e.URL + "/ui/jobs")
	queries := []string{}
	for _, v := range []string{"//evil.example", `/\evil.example`, `\\evil.example`, "https://evil.example/", "http:evil.example",
		"%2F%2Fevil.example", "/%2Fevil.example", "..//evil.example", "\t//evil.example", "javascript:alert(1)"} {
		queries = append(queries, "q="+url.QueryEscape(v), "key=k&path="+url.QueryEscape(v), "key="+url.QueryEscape(v)+"&path=k&tenant="+url.QueryEscape(v))
	}
	redirects := 0
	for _, q := range queries {
		resp, _ := adminuitest.Get(t, c, e.URL+"/ui/jobs?"+q)
		loc := resp.Header.Get("Location")
		if loc == "" {
			continue
		}
		redirects++
		to, err := base.Parse(loc)
		if err != nil || to.Host != base.Host || !strings.HasPrefix(to.Path, "/ui/jobs/") || strings.HasPrefix(loc, "//") || strings.HasPrefix(loc, `/\`) {
			t.Errorf("search %s redirected to %q (%v)", q, loc, to)
		}
	}
	if redirects < 15 {
		t.Fatalf("only %d searches redirected: the test did not reach the redirects", redirects)
	}
}

// Path tricks on /ui/static/ and /ui/jobs/{id} serve no template, no source, no 5xx.
func TestAttackPathTricks(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	c, _ := signedIn(t, e)
	for _, p := range []string{"/ui/static/../templates/login.html", "/ui/static/%2e%2e/templates/login.html", "/ui/static/..%2ftemplates%2flogin.html",
		"/ui/static/..%5ctemplates%5clogin.html", "/ui/static/templates/login.html", "/ui/static//../../ui.go", "/ui/static/ui.css%00.html",
		"/ui/static/ui.js/..%2f..%2fui.go", "/ui/jobs/..%2F..%2Fstatic%2Fui.js", "/ui/jobs/%00", "/ui/jobs/" + strings.Repeat("a", 5000),
		"/ui/jobs/%ff%fe", "/ui/jobs/a%2Fb", "/ui//jobs/x", "/ui/jobs/x/y"} {
		code, h, body := try(c, http.MethodGet, e.URL+p, nil)
		if code >= 500 || strings.Contains(body, "{{") || strings.Contains(body, "package adminui") {
			t.Errorf("%s: %d %.200s", p, code, body)
		}
		if code == http.StatusOK && strings.HasPrefix(p, "/ui/static/") {
			t.Errorf("%s served: %s %.100s", p, h.Get("Content-Type"), body)
		}
	}
	// The static files are served (without a session) with nosniff and the CSP.
	code, h, body := try(adminuitest.Browser(t), http.MethodGet, e.URL+"/ui/static/ui.js", nil)
	if code != http.StatusOK || h.Get("X-Content-Type-Options") != "nosniff" || !strings.Contains(body, "data-live") {
		t.Errorf("ui.js: %d %v", code, h)
	}
	if code, _, body := try(adminuitest.Browser(t), http.MethodGet, e.URL+"/ui/static/", nil); code == http.StatusOK {
		t.Logf("note: /ui/static/ lists its directory: %.200s", body)
	}
}

// Oversized forms, too many ids, malformed ids and an unconfigured queue are refused
// (4xx, never 5xx) and nothing is done.
func TestAttackBadForms(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	adminuitest.DeadLetters(t, e, 1)
	dl, _, _ := queue.ListDead(context.Background(), e.Redis, e.Keys, "", 10)
	adminuitest.OutboxRows(t, e.Client.Inspector().DB(), 2, 1)
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

// "Purge all" confirmed for N dead letters purges only what the operator saw: not the
// dead letters that arrived between the confirmation and the click.
func TestAttackPurgeAllPurgesOnlyWhatWasConfirmed(t *testing.T) {
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

// The sign-in limit counts the connection's address: X-Forwarded-For and friends do not
// reset it, and a success does not either.
func TestAttackSignInLimitNotBypassedByHeaders(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{LoginAttempts: 3})
	for i := range 3 {
		c := adminuitest.Browser(t)
		_, form := adminuitest.Get(t, c, e.URL+"/ui/login")
		ip := fmt.Sprintf("203.0.113.%d", i+1)
		resp, _ := adminuitest.Post(t, c, e.URL+"/ui/login", url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {"wrong-key-0123456789abcdef"}},
			"X-Forwarded-For", ip, "X-Real-IP", ip, "Forwarded", "for="+ip, "True-Client-IP", ip)
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("attempt %d: %d", i+1, resp.StatusCode)
		}
	}
	c := adminuitest.Browser(t)
	_, form := adminuitest.Get(t, c, e.URL+"/ui/login")
	resp, _ := adminuitest.Post(t, c, e.URL+"/ui/login", url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {adminuitest.AdminKey}}, "X-Forwarded-For", "198.51.100.9")
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("a new X-Forwarded-For reset the count: %d", resp.StatusCode)
	}
}

// Concurrent failed sign-ins cannot exceed LoginAttempts: the check and the count must
// be one step. (A client outside a browser forges the login form's double-submit token.)
func TestAttackSignInLimitHoldsUnderConcurrency(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{LoginAttempts: 3})
	var tried, limited atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			req, _ := http.NewRequest(http.MethodPost, e.URL+"/ui/login",
				strings.NewReader(url.Values{"csrf": {"forged-token"}, "key": {fmt.Sprintf("guess-%02d-0123456789abcdef", i)}}.Encode()))
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.AddCookie(&http.Cookie{Name: "onceflow_ui_login", Value: "forged-token"})
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return
			}
			_ = resp.Body.Close()
			switch resp.StatusCode {
			case http.StatusUnauthorized:
				tried.Add(1)
			case http.StatusTooManyRequests:
				limited.Add(1)
			}
		}()
	}
	close(start)
	wg.Wait()
	if n := tried.Load(); n > 3 {
		t.Errorf("40 concurrent guesses with LoginAttempts 3: %d keys were compared (401), %d refused (429)", n, limited.Load())
	}
}

// No log line holds an admin key, a tried key, a session token or a CSRF token.
func TestAttackNoSecretsInLogs(t *testing.T) {
	t.Parallel()
	var buf testenv.SyncBuffer
	rdb, prefix := testenv.Redis(t)
	pool, _ := testenv.Postgres(t)
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	e := serveLogged(t, cl, rdb, adminui.Config{}, &buf)
	adminuitest.DeadLetters(t, e, 2)
	dl, _, _ := queue.ListDead(context.Background(), e.Redis, e.Keys, "", 10)
	const wrong = "wrong-but-close-admin-key-0123"
	for _, k := range []string{wrong, adminuitest.TenantKey, adminuitest.AdminKey + " "} {
		adminuitest.SignIn(t, e, adminuitest.Browser(t), k)
	}
	c, token := signedIn(t, e)
	session := cookieOf(t, c, e.URL, "onceflow_ui")
	adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"replay"}, "id": {dl[0].ID}})
	adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {token + "x"}, "queue": {adminuitest.Queue}, "action": {"replay"}, "id": {dl[1].ID}})
	adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"purge"}, "confirm": {"yes"}, "id": {dl[1].ID}})
	adminuitest.Post(t, c, e.URL+"/ui/outbox", url.Values{"csrf": {token}, "action": {"retry"}, "all": {"1"}, "confirm": {"yes"}})
	adminuitest.Post(t, c, e.URL+"/ui/logout", url.Values{"csrf": {token}})
	logs := buf.String()
	if !strings.Contains(logs, "signed in") || !strings.Contains(logs, "failed sign-in") {
		t.Fatalf("the log was not captured: %.500s", logs)
	}
	sum := sha256.Sum256([]byte(session))
	for name, secret := range map[string]string{"admin key": adminuitest.AdminKey, "tried key": wrong, "tenant key": adminuitest.TenantKey,
		"session token": session, "CSRF token": token, "session id": hex.EncodeToString(sum[:])} {
		if strings.Contains(logs, secret) {
			t.Errorf("the log holds the %s", name)
		}
	}
}

// Headers on every kind of answer; cookies HttpOnly, SameSite=Strict, Path /ui/, and
// Secure over TLS or with SecureCookies.
func TestAttackHeadersAndCookies(t *testing.T) {
	t.Parallel()
	e := adminuitest.New(t, adminui.Config{})
	c, token := signedIn(t, e)
	check := func(what string, h http.Header, page bool) {
		if !strings.Contains(h.Get("Content-Security-Policy"), "frame-ancestors 'none'") || !strings.Contains(h.Get("Content-Security-Policy"), "script-src 'self'") ||
			h.Get("X-Frame-Options") != "DENY" || h.Get("X-Content-Type-Options") != "nosniff" || h.Get("Referrer-Policy") != "same-origin" {
			t.Errorf("%s: security headers %v", what, h)
		}
		if page && h.Get("Cache-Control") != "no-store" {
			t.Errorf("%s: Cache-Control %q", what, h.Get("Cache-Control"))
		}
	}
	for _, p := range []string{"/ui/login", "/ui/", "/ui/dead-letters", "/ui/outbox", "/ui/calls", "/ui/jobs", "/ui/jobs/x", "/ui/nope", "/ui/dead-letters?queue=nope"} {
		resp, _ := adminuitest.Get(t, c, e.URL+p)
		check(p, resp.Header, true)
	}
	_, h, _ := try(c, http.MethodGet, e.URL+"/ui/logout", nil)
	check("405", h, true)
	resp, _ := adminuitest.Post(t, c, e.URL+"/ui/dead-letters", url.Values{"csrf": {"x"}})
	check("403", resp.Header, true)
	_, h, _ = try(adminuitest.Browser(t), http.MethodGet, e.URL+"/ui/static/ui.css", nil)
	check("static", h, false)
	// Sign-out clears the cookie on the same path.
	resp, _ = adminuitest.Post(t, c, e.URL+"/ui/logout", url.Values{"csrf": {token}})
	for _, ck := range resp.Cookies() {
		if ck.Name == "onceflow_ui" && (ck.MaxAge >= 0 || ck.Path != "/ui/" || !ck.HttpOnly) {
			t.Errorf("sign-out cookie: %+v", ck)
		}
	}

	// Over TLS every cookie is Secure.
	rdb, prefix := testenv.Redis(t)
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Logger: testenv.Logger(t), Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	ui, err := adminui.New(adminui.Config{Client: cl, AdminKeys: []string{adminuitest.AdminKey}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewTLSServer(ui)
	t.Cleanup(srv.Close)
	tc := srv.Client()
	tc.Jar, _ = cookiejar.New(nil)
	tc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	te := &adminuitest.Env{URL: srv.URL, Redis: rdb, Client: cl}
	_, form := adminuitest.Get(t, tc, te.URL+"/ui/login")
	resp, _ = adminuitest.Post(t, tc, te.URL+"/ui/login", url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {adminuitest.AdminKey}})
	var got int
	for _, ck := range resp.Cookies() {
		got++
		if !ck.Secure || !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/ui/" {
			t.Errorf("TLS cookie %+v", ck)
		}
	}
	if resp.StatusCode != http.StatusSeeOther || got < 2 {
		t.Errorf("TLS sign-in: %d, %d cookies", resp.StatusCode, got)
	}
	// SecureCookies marks them Secure on plain HTTP too.
	se := adminuitest.New(t, adminui.Config{SecureCookies: true})
	resp, _ = adminuitest.Get(t, adminuitest.Browser(t), se.URL+"/ui/login")
	if cks := resp.Cookies(); len(cks) == 0 || !cks[0].Secure {
		t.Errorf("SecureCookies: %+v", cks)
	}
}

// ---- 2. as an operator in an outage ----

// Redis down: every page and the sign-in answer 503 with Retry-After promptly, the cause
// is logged, sign-in fails closed, and the session is still there when Redis is back.
func TestAttackRedisDownPagesAnswer503(t *testing.T) {
	t.Parallel()
	var buf testenv.SyncBuffer
	e, srv := privateRedisEnv(t, &buf)
	c, token := signedIn(t, e)
	c.Timeout = 4 * time.Second
	lc := adminuitest.Browser(t)
	_, form := adminuitest.Get(t, lc, e.URL+"/ui/login")
	srv.Stop()
	for _, p := range []string{"/ui/", "/ui/dead-letters", "/ui/outbox", "/ui/calls", "/ui/jobs/00000000-0000-4000-8000-000000000001", "/ui/login"} {
		t0 := time.Now()
		code, h, _ := try(c, http.MethodGet, e.URL+p, nil)
		if p == "/ui/login" {
			if code != http.StatusOK && code != http.StatusServiceUnavailable {
				t.Errorf("GET /ui/login with Redis down: %d", code)
			}
			continue
		}
		if code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
			t.Errorf("%s with Redis down: %d (Retry-After %q) after %s", p, code, h.Get("Retry-After"), time.Since(t0))
		}
	}
	code, _, _ := try(c, http.MethodPost, e.URL+"/ui/dead-letters", strings.NewReader(url.Values{"csrf": {token}, "queue": {adminuitest.Queue}, "action": {"replay"}, "all": {"1"}, "confirm": {"yes"}}.Encode()))
	if code != http.StatusServiceUnavailable {
		t.Errorf("bulk replay with Redis down: %d", code)
	}
	lc.Timeout = 4 * time.Second
	code, _, _ = try(lc, http.MethodPost, e.URL+"/ui/login", strings.NewReader(url.Values{"csrf": {adminuitest.CSRF(t, form)}, "key": {adminuitest.AdminKey}}.Encode()))
	if code != http.StatusServiceUnavailable {
		t.Errorf("sign-in with Redis down: %d, want 503 (fail closed)", code)
	}
	if !strings.Contains(buf.String(), "a store failed") {
		t.Errorf("the cause was not logged")
	}
	srv.Start()
	testenv.WaitFor(t, 3*time.Second, "the session after the outage", func() bool {
		code, _, _ := try(c, http.MethodGet, e.URL+"/ui/", nil)
		return code == http.StatusOK
	})
}

// A bulk replay that Redis's crash interrupts midway loses no dead letter (each is
// replayed or still there), and tells the operator that a store failed (503) rather
// than that the rest were malformed messages to purge.
func TestAttackBulkReplayInterruptedByRedisCrash(t *testing.T) {
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

// PostgreSQL down: the outbox and model-call pages and an outbox retry answer 503
// promptly, the job page says which store did not answer, the Redis pages still work,
// and no outbox row changed.
func TestAttackPostgresDown(t *testing.T) {
	t.Parallel()
	var buf testenv.SyncBuffer
	pg, _, pool := testenv.MigratedPrivatePostgres(t, "&connect_timeout=1")
	rdb, prefix := testenv.Redis(t)
	cl, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: pool, Prefix: prefix, Logger: testenv.Logger(t),
		Queues: map[string]onceflow.QueueConfig{adminuitest.Queue: {}}})
	if err != nil {
		t.Fatal(err)
	}
	e := serveLogged(t, cl, rdb, adminui.Config{}, &buf)
	adminuitest.OutboxRows(t, pool, 3, 2)
	c, token := signedIn(t, e)
	c.Timeout = 4 * time.Second
	pg.Stop()
	for p, want := range map[string]int{"/ui/outbox": 503, "/ui/calls": 503, "/ui/": 200, "/ui/dead-letters": 200} {
		if code, _, body := try(c, http.MethodGet, e.URL+p, nil); code != want {
			t.Errorf("%s with PostgreSQL down: %d, want %d (%.100s)", p, code, want, body)
		}
	}
	code, _, body := try(c, http.MethodGet, e.URL+"/ui/jobs/00000000-0000-4000-8000-000000000001", nil)
	if code >= 500 && code != http.StatusServiceUnavailable || !strings.Contains(body, "did not answer") {
		t.Errorf("job page with PostgreSQL down: %d %.300s", code, body)
	}
	for _, f := range []url.Values{
		{"csrf": {token}, "action": {"retry"}, "all": {"1"}, "confirm": {"yes"}},
		{"csrf": {token}, "action": {"retry"}, "all": {"1"}},
		{"csrf": {token}, "action": {"retry"}, "id": {"1", "2"}, "confirm": {"yes"}},
		{"csrf": {token}, "action": {"retry"}, "id": {"1"}},
	} {
		if code, _, _ := try(c, http.MethodPost, e.URL+"/ui/outbox", strings.NewReader(f.Encode())); code != http.StatusServiceUnavailable {
			t.Errorf("outbox retry %v with PostgreSQL down: %d", f, code)
		}
	}
	if !strings.Contains(buf.String(), "a store failed") {
		t.Errorf("the cause was not logged")
	}
	pg.Start()
	var exhausted int
	testenv.WaitFor(t, 3*time.Second, "PostgreSQL back", func() bool {
		return pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`).Scan(&exhausted) == nil
	})
	if exhausted != 2 {
		t.Errorf("after the outage %d rows are exhausted, want 2", exhausted)
	}
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
