package adminui

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Sessions live in Redis, so that every process serving the UI knows them and signing
// out ends them everywhere: Prefix:ui:session:<SHA-256 of the cookie's token>, a hash
// of the admin key's fingerprint and the session's CSRF token, expiring with the
// session. The cookie holds only the random token.
const (
	cookieName      = "onceflow_ui"
	loginCookieName = "onceflow_ui_login" // the login form's double-submit token
	csrfField       = "csrf"
)

// session is a signed-in operator.
type session struct {
	id   string // the Redis key's hash part
	key  string // the fingerprint of the admin key that opened it
	csrf string
}

// fingerprint names an admin key without revealing it: the first 12 hex digits of its
// SHA-256.
func fingerprint(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:6])
}

func randomToken() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

func (u *UI) sessionKey(id string) string { return u.prefix + ":ui:session:" + id }

func sessionID(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// adminKey returns the fingerprint of the admin key equal to key, comparing in constant
// time with each of them; ok is false when key is none of them.
func (u *UI) adminKey(key string) (fp string, ok bool) {
	sum := sha256.Sum256([]byte(key))
	for _, k := range u.keys {
		if subtle.ConstantTimeCompare(sum[:], k.sum[:]) == 1 {
			fp, ok = k.fp, true
		}
	}
	return fp, ok
}

// currentSession returns the session of r's cookie, nil when there is none or it
// ended (expired, signed out, or opened by a key that is no longer configured).
func (u *UI) currentSession(ctx context.Context, r *http.Request) (*session, error) {
	c, err := r.Cookie(cookieName)
	if err != nil || len(c.Value) < 40 || len(c.Value) > 64 {
		return nil, nil
	}
	id := sessionID(c.Value)
	vals, err := u.rdb.HMGet(ctx, u.sessionKey(id), "key", "csrf").Result()
	if err != nil {
		return nil, fmt.Errorf("read session: %w", err)
	}
	fp, _ := vals[0].(string)
	csrf, _ := vals[1].(string)
	if fp == "" || csrf == "" || !u.keyConfigured(fp) {
		return nil, nil
	}
	return &session{id: id, key: fp, csrf: csrf}, nil
}

func (u *UI) keyConfigured(fp string) bool {
	for _, k := range u.keys {
		if k.fp == fp {
			return true
		}
	}
	return false
}

// newSession stores a session for the admin key fp and returns its cookie token.
func (u *UI) newSession(ctx context.Context, fp string) (string, error) {
	token := randomToken()
	key := u.sessionKey(sessionID(token))
	pipe := u.rdb.TxPipeline()
	pipe.HSet(ctx, key, "key", fp, "csrf", randomToken(), "created", u.now().UTC().Format(time.RFC3339))
	pipe.PExpire(ctx, key, u.cfg.SessionTTL)
	if _, err := pipe.Exec(ctx); err != nil {
		return "", fmt.Errorf("store session: %w", err)
	}
	return token, nil
}

// setCookie sets (or, with an empty value and maxAge < 0, clears) a UI cookie: HttpOnly,
// SameSite=Strict, Secure when the request came over TLS (or Config.SecureCookies says
// so), scoped to the UI's path.
func (u *UI) setCookie(w http.ResponseWriter, r *http.Request, name, value string, maxAge int) {
	// #nosec G124 -- HttpOnly and SameSite=Strict always; Secure over TLS or with Config.SecureCookies (a plain-HTTP loopback UI must still sign in)
	http.SetCookie(w, &http.Cookie{
		Name: name, Value: value, Path: u.base, MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil || u.cfg.SecureCookies,
	})
}

// sameOrigin reports whether a state-changing request comes from the UI's own pages:
// a browser sends Origin (or at least Sec-Fetch-Site) with every POST, and a request
// that names another origin is refused whatever its token. Requests without either
// header (not from a browser) rely on the token alone.
func sameOrigin(r *http.Request) bool {
	if o := r.Header.Get("Origin"); o != "" && o != "null" {
		ou, err := url.Parse(o)
		return err == nil && strings.EqualFold(ou.Host, r.Host)
	}
	switch r.Header.Get("Sec-Fetch-Site") {
	case "", "same-origin", "none":
		return true
	}
	return false
}

// validCSRF reports whether r's form carries the session's CSRF token.
func validCSRF(r *http.Request, s *session) bool {
	got := r.PostFormValue(csrfField)
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.csrf)) == 1
}

// clientAddr is the address a login attempt is counted against: the connection's
// peer. Forwarded-for headers are not trusted (anyone can send them).
func clientAddr(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// errTooManyAttempts is returned by takeAttempt past Config.LoginAttempts a minute.
var errTooManyAttempts = errors.New("too many sign-in attempts")

// takeAttempt counts a sign-in attempt from addr before its key is compared, fleet-wide
// and in one atomic step (Prefix:ui:login:<addr>, a counter that expires a minute after
// the first attempt of the window), so that attempts sent in parallel cannot pass the
// limit before they are counted. Past Config.LoginAttempts it returns
// errTooManyAttempts with the time left; a successful sign-in gives its attempt back
// (refundAttempt).
func (u *UI) takeAttempt(ctx context.Context, addr string) (time.Duration, error) {
	key := u.loginKey(addr)
	pipe := u.rdb.TxPipeline()
	n := pipe.Incr(ctx, key)
	pipe.ExpireNX(ctx, key, time.Minute)
	ttl := pipe.PTTL(ctx, key)
	if _, err := pipe.Exec(ctx); err != nil {
		return 0, fmt.Errorf("count sign-in attempts: %w", err)
	}
	if n.Val() > int64(u.cfg.LoginAttempts) {
		return max(ttl.Val(), time.Second), errTooManyAttempts
	}
	return 0, nil
}

// refundAttempt gives back the attempt of a sign-in that succeeded.
func (u *UI) refundAttempt(ctx context.Context, addr string) {
	if err := u.rdb.Decr(ctx, u.loginKey(addr)).Err(); err != nil {
		u.log.WarnContext(ctx, "adminui: could not give back a successful sign-in's attempt", "err", err)
	}
}

func (u *UI) loginKey(addr string) string { return u.prefix + ":ui:login:" + addr }

// login serves GET and POST /ui/login.
func (u *UI) login(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	if r.Method == http.MethodGet {
		if s, _ := u.currentSession(ctx, r); s != nil {
			http.Redirect(w, r, u.base, http.StatusSeeOther)
			return
		}
		token := randomToken()
		u.setCookie(w, r, loginCookieName, token, 600)
		u.render(w, r, http.StatusOK, "login", page{Title: "Sign in", Login: token})
		return
	}
	fail := func(status int, msg string) {
		token := randomToken()
		u.setCookie(w, r, loginCookieName, token, 600)
		u.render(w, r, status, "login", page{Title: "Sign in", Login: token, Error: msg})
	}
	c, err := r.Cookie(loginCookieName)
	if !sameOrigin(r) || err != nil || r.PostFormValue(csrfField) == "" ||
		subtle.ConstantTimeCompare([]byte(c.Value), []byte(r.PostFormValue(csrfField))) != 1 {
		fail(http.StatusForbidden, "The sign-in form expired or came from another site. Please try again.")
		return
	}
	addr := clientAddr(r)
	if wait, err := u.takeAttempt(ctx, addr); err != nil {
		if errors.Is(err, errTooManyAttempts) {
			w.Header().Set("Retry-After", strconv.Itoa(int((wait+time.Second-1)/time.Second)))
			fail(http.StatusTooManyRequests, fmt.Sprintf("Too many failed sign-ins from this address. Try again in %d seconds.", int((wait+time.Second-1)/time.Second)))
			return
		}
		u.unavailable(w, r, err)
		return
	}
	fp, ok := u.adminKey(r.PostFormValue("key"))
	if !ok {
		u.log.WarnContext(ctx, "adminui: failed sign-in", "addr", addr)
		fail(http.StatusUnauthorized, "That is not an admin key.")
		return
	}
	u.refundAttempt(ctx, addr)
	token, err := u.newSession(ctx, fp)
	if err != nil {
		u.unavailable(w, r, err)
		return
	}
	u.log.InfoContext(ctx, "adminui: signed in", "admin_key", fp, "addr", addr)
	u.setCookie(w, r, loginCookieName, "", -1)
	u.setCookie(w, r, cookieName, token, int(u.cfg.SessionTTL/time.Second))
	http.Redirect(w, r, u.base, http.StatusSeeOther)
}

// logout serves POST /ui/logout: it ends the session everywhere.
func (u *UI) logout(w http.ResponseWriter, r *http.Request, s *session) {
	if err := u.rdb.Del(r.Context(), u.sessionKey(s.id)).Err(); err != nil {
		u.unavailable(w, r, err)
		return
	}
	u.setCookie(w, r, cookieName, "", -1)
	http.Redirect(w, r, u.base+"login", http.StatusSeeOther)
}
