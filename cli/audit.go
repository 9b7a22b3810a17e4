package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/summaries"
)

// errViolations is returned by audit when an invariant does not hold: exit 4.
var errViolations = errors.New("invariants violated")

// runAudit checks the summaries pipeline's invariants on live data and prints the counts:
// a table, or one JSON object with --json. It exits 4 when an invariant is violated. In a
// program with App.Workflows it runs runAuditHosted instead.
func runAudit(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "audit", "[--json]")
	loader := config.Register(fs)
	asJSON := fs.Bool("json", false, "print one JSON object on stdout")
	cfg, log, err := load(e, fs, loader, args)
	if err != nil {
		return err
	}
	if e.hosted() {
		return runAuditHosted(ctx, e, cfg, log, *asJSON)
	}
	d, err := newDeps(ctx, cfg, log, true, true)
	if err != nil {
		return err
	}
	defer d.Close()
	r, err := summaries.Audit(ctx, summaries.AuditConfig{
		DB: d.pool, Redis: d.rdb, Keys: d.keys(),
		ClaimIdle: cfg.ClaimIdle, MaxAge: cfg.AuditMaxAge, Retention: cfg.OutboxRetention,
	})
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			return err
		}
	} else {
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		for _, row := range []struct {
			name string
			n    int64
		}{
			{"summaries", r.Summaries}, {"outbox rows", r.OutboxTotal}, {"  sent", r.OutboxSent},
			{"  unsent", r.OutboxUnsent}, {"  exhausted", r.OutboxExhausted}, {"dead-lettered jobs", r.DLQ},
			{"stream entries", r.StreamLength}, {"  pending", r.StreamPending},
		} {
			fmt.Fprintf(tw, "%s\t%d\n", row.name, row.n)
		}
		_ = tw.Flush()
		if len(r.LLMCalls) > 0 {
			fmt.Fprintln(e.stdout, "\nmodel calls (llm_calls ledger):")
			tw = tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "provider\tmodel\tcalls\tsucceeded\tfailed\tin flight\tabandoned\tattempts\tambiguous\t")
			for _, c := range r.LLMCalls {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", c.Provider, c.Model, c.Calls, c.Succeeded, c.Failed,
					c.InFlight, c.Abandoned, c.Attempts, c.Ambiguous)
			}
			_ = tw.Flush()
		}
		if len(r.Violations) == 0 {
			fmt.Fprintln(e.stdout, "invariants: all hold")
		}
		for _, v := range r.Violations {
			fmt.Fprintln(e.stdout, "VIOLATION:", v)
		}
	}
	if len(r.Violations) > 0 {
		return &exitError{code: 4, err: fmt.Errorf("%w: %d", errViolations, len(r.Violations))}
	}
	return nil
}
