package limiter

import (
	"strings"
	"time"
)

// Keys names the limiter's Redis keys (see the comment at the top of scripts.go). Every
// key is Prefix:{limits}:..., one Redis Cluster hash slot. Keys is a plain value, safe
// to copy and to use from many goroutines.
type Keys struct {
	// Prefix is the deployment's key prefix (ONCEFLOW_PREFIX).
	Prefix string
}

func (k Keys) base() string { return k.Prefix + ":{limits}:" }

// part escapes a model's or a tenant's name for a key: '%' and ':' become %25 and %3A,
// so that no name ("m:inflight", a fine-tune's "ft:gpt-4o:org:id") can spell another
// name's key. Names without those characters are kept as they are.
func part(s string) string {
	if !strings.ContainsAny(s, "%:|") {
		return s
	}
	return keyEscaper.Replace(s)
}

var (
	keyEscaper   = strings.NewReplacer("%", "%25", ":", "%3A", "|", "%7C")
	keyUnescaper = strings.NewReplacer("%25", "%", "%3A", ":", "%7C", "|")
)

// Model returns the hash of a model's buckets, pause and learnt limits:
// Prefix:{limits}:m:<model>, model being "provider/name" (a name's '%', ':' and '|'
// escaped as %25, %3A and %7C, in every key that holds a model or tenant name).
func (k Keys) Model(model string) string { return k.base() + "m:" + part(model) }

// InFlight returns the sorted set of a model's permits in flight.
func (k Keys) InFlight(model string) string { return k.Model(model) + ":inflight" }

// Lines returns the hash of a model's tenant lines, waiting marks and recent usage.
func (k Keys) Lines(model string) string { return k.Model(model) + ":lines" }

// Places returns the sorted set of the calls holding a place in a model's lines.
func (k Keys) Places(model string) string { return k.Model(model) + ":places" }

// TenantInFlight returns the sorted set of a tenant's permits in flight, across models.
func (k Keys) TenantInFlight(tenant string) string {
	return k.base() + "t:" + part(tenant) + ":inflight"
}

// Budget returns the hash of a tenant's tokens used and reserved on day (UTC).
func (k Keys) Budget(tenant string, day time.Time) string {
	return k.base() + "t:" + part(tenant) + ":budget:" + day.UTC().Format("2006-01-02")
}

// Held returns the sorted set of the permits holding a reservation of a tenant's budget
// on day, scored by their lease's end.
func (k Keys) Held(tenant string, day time.Time) string { return k.Budget(tenant, day) + ":held" }

// Usage returns the hash of every tenant's tokens on day by model, for the cost view:
// field "<tenant>|<model>|in" and "...|out" (tokens), "...|calls", the names escaped
// as in the other keys.
func (k Keys) Usage(day time.Time) string {
	return k.base() + "usage:" + day.UTC().Format("2006-01-02")
}

// Released returns the mark a released admission leaves (a string, for a lease): an
// admission of that permit that comes after its release admits nothing.
func (k Keys) Released(permit string) string { return k.base() + "r:" + permit }

// Budgets returns the hash of the tenants' own budgets (tokens per day) as last read
// from Config.Budgets: a copy for processes that start while that store is down.
func (k Keys) Budgets() string { return k.base() + "budgets" }

// Events returns the Pub/Sub channel on which pauses are announced.
func (k Keys) Events() string { return k.base() + "events" }
