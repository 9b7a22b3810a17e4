package adminui

import (
	"fmt"
	"html/template"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// pages are the templates, each parsed with layout.html.
var pages = []string{"login", "message", "overview", "dead-letters", "confirm", "outbox", "job", "search", "calls", "approvals", "shadows"}

func parseTemplates(base string) (map[string]*template.Template, error) {
	funcs := template.FuncMap{
		"base": func() string { return base },
		"age":  age,
		"dur":  dur,
		"when": func(t time.Time) string {
			if t.IsZero() {
				return "–"
			}
			return t.UTC().Format("2006-01-02 15:04:05 UTC")
		},
		"iso":  func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
		"span": span,
		"ms":   func(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) },
		// jobLink renders a ledger row's work (step/job) with the job linked to its page.
		"jobLink": func(work string) template.HTML {
			step, job, ok := strings.Cut(work, "/")
			if !ok || job == "" {
				return template.HTML(template.HTMLEscapeString(work)) // #nosec G203 -- escaped
			}
			return template.HTML(template.HTMLEscapeString(step) + "/<a href=\"" + template.HTMLEscapeString(base+"jobs/"+url.PathEscape(job)) + "\"><code>" + // #nosec G203 -- escaped
				template.HTMLEscapeString(job) + "</code></a>")
		},
	}
	out := map[string]*template.Template{}
	for _, name := range pages {
		t, err := template.New(name).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("adminui: parse %s: %w", name, err)
		}
		out[name] = t
	}
	return out, nil
}

// age renders a duration the way an operator reads it: "4s", "3m 12s", "2h 5m", "3d 4h".
func age(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	s := int64(d / time.Second)
	switch {
	case s < 60:
		return fmt.Sprintf("%ds", s)
	case s < 3600:
		return fmt.Sprintf("%dm %ds", s/60, s%60)
	case s < 86400:
		return fmt.Sprintf("%dh %dm", s/3600, s%3600/60)
	}
	return fmt.Sprintf("%dd %dh", s/86400, s%86400/3600)
}

// dur renders a run's or a wait's duration: milliseconds below a second, else as age.
func dur(d time.Duration) string {
	if d < time.Second {
		return strconv.FormatInt(max(d.Milliseconds(), 0), 10) + " ms"
	}
	return age(d)
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
