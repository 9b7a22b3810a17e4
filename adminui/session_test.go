package adminui_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// Only a configured admin key, exactly, opens the UI; no refused key sets a session.
func TestOnlyAdminKeysOpenTheUI(t *testing.T) {
	t.Parallel()
	// Tenant API keys, wrong keys and a removed admin key do not open the UI.
	t.Run("tenant keys, wrong keys and a removed admin key", func(t *testing.T) {
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
	})
	// Not the key with whitespace, in another case, with a NUL or non-ASCII byte, nor a very
	// long key; none sets a session, and a key past the form limit is refused without a
	// 5xx.
	t.Run("variants of the admin key", func(t *testing.T) {
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
	})
}

// A cookie value an attacker chose never becomes a session: sign-in issues a fresh token.
func TestAChosenCookieNeverBecomesASession(t *testing.T) {
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

// Every POST needs the session's CSRF token and the UI's own origin: without them it is
// refused with 403 and nothing is done.
func TestPostsWithoutTheSessionsTokenDoNothing(t *testing.T) {
	t.Parallel()
	// No token, a wrong one, another session's, another origin, a cross-site fetch, no
	// session, a sign-in without its form: 403; the same POST with the token and the UI's
	// origin works.
	t.Run("a missing, wrong or foreign token or origin", func(t *testing.T) {
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
	})
	// A token of an ended session, a token in the query, method overrides, Sec-Fetch-Site
	// same-site or cross-site without Origin and Origin "null" are refused; GETs never
	// change state (the action's fields in a GET, GET /ui/logout is 405).
	t.Run("an ended session's token, a token in the query, method overrides, null origins", func(t *testing.T) {
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
	})
}

// Failed sign-ins are limited per connection address (LoginAttempts): past the limit
// even the right key is refused with 429 and Retry-After.
func TestSignInLimit(t *testing.T) {
	t.Parallel()
	// Failed sign-ins are counted per address across processes: past the limit even the
	// right key is refused with 429 and Retry-After.
	t.Run("counts failures per address across processes", func(t *testing.T) {
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
	})
	// A successful sign-in gives its attempt back: an operator who signs in, out and in
	// again is not counted against the limit like a guesser.
	t.Run("is not spent by successful sign-ins", func(t *testing.T) {
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
	})
	// The limit counts the connection's address: X-Forwarded-For and friends do not reset
	// it.
	t.Run("is not reset by forwarding headers", func(t *testing.T) {
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
	})
	// Concurrent failed sign-ins cannot exceed LoginAttempts: the check and the count must
	// be one step. (A client outside a browser forges the login form's double-submit token.)
	t.Run("holds under concurrent guesses", func(t *testing.T) {
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
	})
}
