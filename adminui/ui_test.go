package adminui_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/queue"
)

const xss = `"'><b>XSS</b><script>alert(1)</script>`

// Every stored field (a dead letter, an outbox row, a model call whose every field is
// hostile) and every echoed input is escaped on every page, and no page redirects out
// of the UI.
func TestEveryPageEscapesStoredAndEchoedValues(t *testing.T) {
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
		"/ui/approvals", "/ui/approvals?tenant=" + url.QueryEscape(xss), "/ui/approvals?done=" + url.QueryEscape(xss),
		"/ui/jobs/" + url.PathEscape(xss) + "?done=" + url.QueryEscape(xss),
		"/ui/shadows?step=" + url.QueryEscape(xss), "/ui/shadows?since=" + url.QueryEscape(xss),
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

// Path tricks on /ui/static/ and /ui/jobs/{id} serve no template, no source, no 5xx.
func TestPathTricksServeNoTemplateOrSource(t *testing.T) {
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

// Every kind of answer carries the security headers (CSP, X-Frame-Options, nosniff,
// Referrer-Policy; no-store on pages); cookies are HttpOnly, SameSite=Strict, Path /ui/,
// and Secure over TLS or with SecureCookies.
func TestSecurityHeadersAndCookieFlags(t *testing.T) {
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
	for _, p := range []string{"/ui/login", "/ui/", "/ui/dead-letters", "/ui/outbox", "/ui/calls", "/ui/jobs", "/ui/jobs/x", "/ui/nope", "/ui/dead-letters?queue=nope", "/ui/approvals", "/ui/approvals?tenant=a/b", "/ui/shadows", "/ui/shadows?since=x"} {
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

// No log line holds an admin key, a tried key, a session token or a CSRF token.
func TestNoSecretsInLogs(t *testing.T) {
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

// A store that does not answer is a prompt 503 with Retry-After on the pages that need
// it, with the cause logged; the UI is back when the store is.
func TestPagesDuringAStoreOutage(t *testing.T) {
	t.Parallel()
	// Redis down: every page and the sign-in answer 503 with Retry-After promptly, the cause
	// is logged, sign-in fails closed, and the session is still there when Redis is back.
	t.Run("Redis down", func(t *testing.T) {
		t.Parallel()
		var buf testenv.SyncBuffer
		e, srv := privateRedisEnv(t, &buf)
		c, token := signedIn(t, e)
		c.Timeout = 4 * time.Second
		lc := adminuitest.Browser(t)
		_, form := adminuitest.Get(t, lc, e.URL+"/ui/login")
		srv.Stop()
		for _, p := range []string{"/ui/", "/ui/dead-letters", "/ui/outbox", "/ui/calls", "/ui/approvals", "/ui/jobs/00000000-0000-4000-8000-000000000001", "/ui/login"} {
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
		testenv.WaitFor(t, 15*time.Second, "the session after the outage", func() bool {
			code, _, _ := try(c, http.MethodGet, e.URL+"/ui/", nil)
			return code == http.StatusOK
		})
	})
	// PostgreSQL down: the outbox, model-call, approvals and shadows pages and an outbox
	// retry answer 503 promptly, the job page says which store did not answer, the Redis
	// pages still work, and no outbox row changed.
	t.Run("PostgreSQL down", func(t *testing.T) {
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
		// A job on the client's queue, for a decision that gets as far as PostgreSQL.
		parked, err := cl.Enqueue(context.Background(), outageJob{}, &onceflow.EnqueueOpts{Queue: adminuitest.Queue})
		if err != nil {
			t.Fatal(err)
		}
		c, token := signedIn(t, e)
		c.Timeout = 4 * time.Second
		pg.Stop()
		for p, want := range map[string]int{"/ui/outbox": 503, "/ui/calls": 503, "/ui/approvals": 503, "/ui/shadows": 503, "/ui/": 200, "/ui/dead-letters": 200} {
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
		decision := url.Values{"csrf": {token}, "job": {parked.JobID}, "key": {"tool-" + strings.Repeat("a", 64)}, "decision": {"approve"}}
		if code, _, _ := try(c, http.MethodPost, e.URL+"/ui/approvals", strings.NewReader(decision.Encode())); code != http.StatusServiceUnavailable {
			t.Errorf("an approval with PostgreSQL down: %d", code)
		}
		if !strings.Contains(buf.String(), "a store failed") {
			t.Errorf("the cause was not logged")
		}
		pg.Start()
		var exhausted int
		testenv.WaitFor(t, 15*time.Second, "PostgreSQL back", func() bool {
			return pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE exhausted_at IS NOT NULL`).Scan(&exhausted) == nil
		})
		if exhausted != 2 {
			t.Errorf("after the outage %d rows are exhausted, want 2", exhausted)
		}
	})
}

// outageJob is a job of no worker's, enqueued for a decision during an outage.
type outageJob struct{}

func (outageJob) Kind() string { return "ui.outage" }
