package adminui

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
)

// Defaults of Config's fields.
const (
	DefaultSessionTTL     = 8 * time.Hour
	DefaultLoginAttempts  = 10
	DefaultBase           = "/ui/"
	DefaultSampleInterval = time.Minute
	// MinKeyLength is the least length of an admin key.
	MinKeyLength = 16
)

// Config configures the UI. Zero fields take the Default* values.
type Config struct {
	// Client is the onceflow client whose queues, dead letters, outbox and model calls
	// the UI shows and acts on (its Redis, its DB, its queues). Required.
	Client *onceflow.Client
	// AdminKeys open the UI: each at least MinKeyLength printable ASCII characters
	// without spaces. Tenant API keys
	// never do (keep them apart: `onceflow serve` refuses a key that is both).
	// Required.
	AdminKeys []string
	// Base is the path the UI is served under, with a trailing slash. Default: "/ui/".
	Base string
	// SessionTTL is how long a sign-in lasts. Default: 8h.
	SessionTTL time.Duration
	// LoginAttempts is how many failed sign-ins one address may make per minute, across
	// every process (counted in Redis). Default: 10.
	LoginAttempts int
	// SecureCookies marks the cookies Secure even on requests that arrived without TLS
	// (behind a proxy that terminates it). Requests over TLS always get Secure cookies.
	SecureCookies bool
	// JobTTL is how long a purged dead letter's job still reads as failed (queue.Purge's
	// ttl; negative: it is forgotten at once), as `onceflow dlq purge` gives it.
	// Default: queue.DefaultJobTTL.
	JobTTL time.Duration
	// SampleInterval is how often Run samples the queues' counters for the overview's
	// chart of the last hour (one bar per interval). Default: 1m.
	SampleInterval time.Duration
	// Logger receives sign-ins and failures. Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock. Default: time.Now.
	Now func() time.Time
}

// UI is the operator UI, an http.Handler for the paths under Config.Base. Its
// methods are safe for concurrent use.
type UI struct {
	cfg    Config
	client *onceflow.Client
	rdb    redis.UniversalClient
	db     *pgxpool.Pool
	prefix string
	base   string
	keys   []adminKey
	log    *slog.Logger
	// outbox and ledger read the outbox and the model-call ledger: nil without a DB.
	outbox *pgoutbox.Store
	ledger *ledger.Ledger
	tmpl   map[string]*template.Template
	static http.Handler
	mux    *http.ServeMux
}

type adminKey struct {
	sum [32]byte
	fp  string
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// New returns the UI of cfg, or an error naming what is wrong with it.
func New(cfg Config) (*UI, error) {
	if cfg.Client == nil {
		return nil, errors.New("adminui: Config.Client is required")
	}
	if len(cfg.AdminKeys) == 0 {
		return nil, errors.New("adminui: Config.AdminKeys needs at least one key")
	}
	cfg.Base = cmp.Or(cfg.Base, DefaultBase)
	if !strings.HasPrefix(cfg.Base, "/") || !strings.HasSuffix(cfg.Base, "/") {
		return nil, fmt.Errorf("adminui: Config.Base %q must begin and end with a slash", cfg.Base)
	}
	cfg.SessionTTL = cmp.Or(cfg.SessionTTL, DefaultSessionTTL)
	cfg.LoginAttempts = cmp.Or(cfg.LoginAttempts, DefaultLoginAttempts)
	cfg.JobTTL = cmp.Or(cfg.JobTTL, queue.DefaultJobTTL)
	cfg.SampleInterval = cmp.Or(cfg.SampleInterval, DefaultSampleInterval)
	if cfg.SampleInterval < time.Second || cfg.SampleInterval > 10*time.Minute {
		return nil, errors.New("adminui: SampleInterval must be between 1s and 10m")
	}
	if cfg.SessionTTL < time.Minute || cfg.LoginAttempts < 1 {
		return nil, errors.New("adminui: SessionTTL must be at least a minute and LoginAttempts at least 1")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	u := &UI{cfg: cfg, client: cfg.Client, rdb: cfg.Client.Inspector().Redis(), db: cfg.Client.Inspector().DB(), base: cfg.Base, log: cfg.Logger}
	if u.rdb == nil {
		return nil, errors.New("adminui: the client has no Redis")
	}
	u.prefix = cfg.Client.Inspector().QueueKeys("ui").Prefix
	if u.db != nil {
		u.outbox = pgoutbox.New(u.db)
		if u.ledger = cfg.Client.Inspector().Ledger(); u.ledger == nil {
			// A client without a model (serve's) reads the ledger all the same.
			l, err := ledger.New(u.db, ledger.Config{Logger: cfg.Logger})
			if err != nil {
				return nil, fmt.Errorf("adminui: %w", err)
			}
			u.ledger = l
		}
	}
	for _, k := range cfg.AdminKeys {
		if len(k) < MinKeyLength || strings.ContainsFunc(k, func(r rune) bool { return r <= ' ' || r > '~' }) {
			return nil, fmt.Errorf("adminui: an admin key must be at least %d printable ASCII characters without spaces", MinKeyLength)
		}
		u.keys = append(u.keys, adminKey{sum: sha256.Sum256([]byte(k)), fp: fingerprint(k)})
	}
	var err error
	if u.tmpl, err = parseTemplates(u.base); err != nil {
		return nil, err
	}
	sub, _ := fs.Sub(staticFS, "static")
	files := http.FileServerFS(sub)
	u.static = http.StripPrefix(u.base+"static/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "" || strings.HasSuffix(r.URL.Path, "/") {
			http.NotFound(w, r) // no listing of the files
			return
		}
		files.ServeHTTP(w, r)
	}))
	u.routes()
	return u, nil
}

// routes registers the UI's pages. Every page but the sign-in form and the static
// files needs a session; every POST needs the session's CSRF token too.
func (u *UI) routes() {
	m := http.NewServeMux()
	b := u.base
	m.HandleFunc("GET "+b+"login", u.login)
	m.HandleFunc("POST "+b+"login", u.login)
	m.Handle("GET "+b+"static/", u.static)
	m.Handle("GET "+b+"{$}", u.page(u.overview))
	m.Handle("GET "+b+"dead-letters", u.page(u.deadLetters))
	m.Handle("POST "+b+"dead-letters", u.action(u.deadLetterAction))
	m.Handle("GET "+b+"outbox", u.page(u.outboxPage))
	m.Handle("POST "+b+"outbox", u.action(u.outboxAction))
	m.Handle("GET "+b+"calls", u.page(u.calls))
	m.Handle("GET "+b+"shadows", u.page(u.shadows))
	m.Handle("GET "+b+"jobs", u.page(u.jobSearch))
	m.Handle("GET "+b+"jobs/{id}", u.page(u.job))
	m.Handle("POST "+b+"jobs/{id}", u.action(u.jobAction))
	m.Handle("GET "+b+"approvals", u.page(u.approvals))
	m.Handle("POST "+b+"approvals", u.action(u.approvalAction))
	m.Handle("POST "+b+"logout", u.action(u.logout))
	u.mux = m
}

// ServeHTTP implements http.Handler.
func (u *UI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// The UI's pages are its own: no framing, no other origins' scripts, no caching.
	h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	if !strings.HasPrefix(r.URL.Path, u.base+"static/") {
		h.Set("Cache-Control", "no-store")
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	u.mux.ServeHTTP(w, r)
}

// maxFormBytes bounds a form's body: a bulk action names at most a few thousand ids.
const maxFormBytes = 256 << 10

// page wraps a GET handler: without a session, the sign-in form.
func (u *UI) page(h func(http.ResponseWriter, *http.Request, *session)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s, err := u.currentSession(r.Context(), r)
		if err != nil {
			u.unavailable(w, r, err)
			return
		}
		if s == nil {
			http.Redirect(w, r, u.base+"login", http.StatusSeeOther)
			return
		}
		h(w, r, s)
	})
}

// action wraps a POST handler: it needs a session, the same origin and the session's
// CSRF token; otherwise 403 and nothing is done.
func (u *UI) action(h func(http.ResponseWriter, *http.Request, *session)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s, err := u.currentSession(r.Context(), r)
		if err != nil {
			u.unavailable(w, r, err)
			return
		}
		if s == nil {
			u.forbidden(w, r, nil, "You are not signed in (or your session ended). Sign in and try again.")
			return
		}
		if err := r.ParseForm(); err != nil {
			u.forbidden(w, r, s, "The form could not be read.")
			return
		}
		if !sameOrigin(r) || !validCSRF(r, s) {
			u.log.WarnContext(r.Context(), "adminui: refused a POST without a valid CSRF token or from another origin", "path", r.URL.Path, "addr", clientAddr(r))
			u.forbidden(w, r, s, "This form expired or came from another site: nothing was done. Reload the page and try again.")
			return
		}
		h(w, r, s)
	})
}

// page is what every template gets.
type page struct {
	Title   string
	Base    string
	Nav     string // the current page, for the navigation
	CSRF    string // the session's token; empty when signed out
	Login   string // the sign-in form's token
	Error   string
	Notice  string
	Live    string // the URL the page's numbers refresh from, if any
	Data    any
	Now     time.Time
	Elapsed time.Duration
}

// render writes the template name with p, or a plain 500 when it fails.
func (u *UI) render(w http.ResponseWriter, r *http.Request, status int, name string, p page) {
	p.Base = u.base
	if p.Now.IsZero() {
		p.Now = u.now()
	}
	var buf bytes.Buffer
	if err := u.tmpl[name].ExecuteTemplate(&buf, "layout", p); err != nil {
		u.log.ErrorContext(r.Context(), "adminui: render", "page", name, "err", err)
		http.Error(w, "the page could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

func (u *UI) forbidden(w http.ResponseWriter, r *http.Request, s *session, msg string) {
	p := page{Title: "Refused", Error: msg}
	if s != nil {
		p.CSRF = s.csrf
	}
	u.render(w, r, http.StatusForbidden, "message", p)
}

// unavailable answers a request that a store failed: 503, the detail in the log.
func (u *UI) unavailable(w http.ResponseWriter, r *http.Request, err error) {
	u.log.ErrorContext(r.Context(), "adminui: a store failed", "path", r.URL.Path, "err", err)
	w.Header().Set("Retry-After", "5")
	u.render(w, r, http.StatusServiceUnavailable, "message", page{Title: "Unavailable",
		Error: "Redis or PostgreSQL did not answer; the page will work again once they do."})
}

func (u *UI) now() time.Time { return u.cfg.Now() }
