package adminui

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"unicode/utf8"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
)

// maxResultBytes bounds the result an operator types for a call that happened (the
// model reads it as the tool's result).
const maxResultBytes = 64 << 10

// jobAction serves POST /ui/jobs/{id}: action resolve, on the call key of the job in
// doubt (of tenant): outcome happened, with the result the model reads, or not-happened
// (the job calls the tool again). Once no call of the job is left in doubt, the job
// goes back on its queue (Inspector.ResolveInDoubt).
func (u *UI) jobAction(w http.ResponseWriter, r *http.Request, s *session) {
	id := r.PathValue("id")
	if !queue.ValidJobID(id) {
		u.render(w, r, http.StatusNotFound, "message", page{Title: "No such job", CSRF: s.csrf, Error: "That is not a job id."})
		return
	}
	if r.PostFormValue("action") != "resolve" {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Unknown action", CSRF: s.csrf, Error: "The action must be resolve."})
		return
	}
	key, tenant, outcome := r.PostFormValue("key"), r.PostFormValue("tenant"), r.PostFormValue("outcome")
	if !validCallKey(key) || (tenant != "" && !queue.ValidTenant(tenant)) || (outcome != "happened" && outcome != "not-happened") {
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad form", CSRF: s.csrf, Error: "The call's key, the tenant or the outcome is malformed."})
		return
	}
	res := onceflow.Resolution{Happened: outcome == "happened", Result: r.PostFormValue("result")}
	switch {
	case res.Happened && strings.TrimSpace(res.Result) == "":
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "No result", CSRF: s.csrf, Error: "Nothing was done: say what the call returned (the model reads it as the tool's result)."})
		return
	case len(res.Result) > maxResultBytes || !utf8.ValidString(res.Result):
		u.render(w, r, http.StatusBadRequest, "message", page{Title: "Bad result", CSRF: s.csrf, Error: "Nothing was done: the result must be text of at most 64 KiB."})
		return
	case !res.Happened:
		res.Result = ""
	}
	if u.db == nil {
		u.render(w, r, http.StatusNotFound, "message", page{Title: "No tool calls", CSRF: s.csrf, Error: "This client has no PostgreSQL, so no tool calls in doubt."})
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	done := outcome
	switch err := u.client.Inspector().ResolveInDoubt(ctx, tenant, id, key, res); {
	case errors.Is(err, onceflow.ErrNotInDoubt):
		done = "gone" // resolved meanwhile (another operator, the CLI)
	case errors.Is(err, onceflow.ErrJobNotFound):
		done = "recorded" // the decision stands; the job had no dead letter to put back
	case err != nil:
		u.unavailable(w, r, err)
		return
	}
	u.log.InfoContext(ctx, "adminui: tool call in doubt resolved", "outcome", outcome, "result", done, "job_id", id, "tenant", tenant, "key", key, "admin_key", s.key)
	// #nosec G710 -- the target is the UI's own page: its base, a valid job id path-escaped (no slash survives) and a fixed word
	http.Redirect(w, r, u.base+"jobs/"+url.PathEscape(id)+"?done="+done, http.StatusSeeOther)
}

// resolveDoneText renders the outcome of a resolution, from fixed words only.
func resolveDoneText(r *http.Request) string {
	return map[string]string{
		"happened":     "Recorded: the call happened. Once no call of the job is in doubt, the job goes on from its result, without calling the tool.",
		"not-happened": "Recorded: the call did not happen. Once no call of the job is in doubt, the job runs again and calls the tool.",
		"gone":         "Nothing was done: that call is not in doubt any more (resolved meanwhile).",
		"recorded":     "The decision is recorded, but the job had no dead letter to put back on its queue (purged or replayed already): replay it yourself if it was purged.",
	}[r.FormValue("done")]
}
