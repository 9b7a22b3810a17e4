package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
)

const outboxUsage = "list [--failed] [--json] [--limit N] [--topic TOPIC] | retry ID...|--all"

// runOutbox inspects outbox rows (list) and makes exhausted rows due again (retry).
func runOutbox(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "outbox", outboxUsage, args); err != nil {
		return err
	}
	switch args[0] {
	case "list":
		return outboxList(ctx, e, args[1:])
	case "retry":
		return outboxRetry(ctx, e, args[1:])
	default:
		return usageErrorf("unknown outbox command %q; usage: %s outbox %s", args[0], e.app.Name, outboxUsage)
	}
}

func outboxList(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "outbox list", "[--failed] [--json] [--limit N] [--topic TOPIC]", config.GroupPostgres)
	topic := fs.String("topic", "", `only this topic's rows, or a prefix's ending in "." or "*" ("email.")`)
	failed := fs.Bool("failed", false, "only exhausted rows (those that wait for outbox retry)")
	asJSON := fs.Bool("json", false, "print a JSON array on stdout")
	limit := fs.Int("limit", 100, "at most this many rows, newest first")
	cfg, _, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErrorf("outbox list takes no arguments, got %q", fs.Args())
	}
	if *limit < 1 {
		return usageErrorf("--limit must be at least 1")
	}
	pool, err := onceflow.NewPostgres(ctx, cfg.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := pgoutbox.New(pool).List(ctx, pgoutbox.ListOptions{Failed: *failed, Limit: *limit, Topic: *topic})
	if err != nil {
		return err
	}
	if *asJSON {
		if rows == nil {
			rows = []pgoutbox.Row{}
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tSTATE\tATTEMPTS\tTOPIC\tDEDUPE_KEY\tCREATED\tLAST_ERROR")
	for _, r := range rows {
		fmt.Fprintf(w, "%d\t%s\t%d\t%s\t%s\t%s\t%s\n", r.ID, r.State, r.Attempts, r.Topic, r.DedupeKey,
			r.CreatedAt.UTC().Format(time.RFC3339), outboxCell(r.LastError, 80))
	}
	return w.Flush()
}

func outboxRetry(ctx context.Context, e *env, args []string) error {
	fs := flags(e, "outbox retry", "ID...|--all", config.GroupPostgres)
	all := fs.Bool("all", false, "reset every exhausted row")
	cfg, _, err := load(e, fs, config.Register(fs), args)
	if err != nil {
		return err
	}
	if *all == (fs.NArg() > 0) {
		return usageErrorf("outbox retry takes row ids or --all")
	}
	var ids []int64
	for _, a := range fs.Args() {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id < 1 {
			return usageErrorf("outbox retry: %q is not a row id", a)
		}
		ids = append(ids, id)
	}
	pool, err := onceflow.NewPostgres(ctx, cfg.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	store := pgoutbox.New(pool)
	if *all {
		n, err := store.RetryAll(ctx)
		if err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "%d exhausted rows reset\n", n)
		return nil
	}
	var failed []error
	for _, id := range ids {
		if err := store.Retry(ctx, id); err != nil {
			failed = append(failed, err)
			continue
		}
		fmt.Fprintf(e.stdout, "row %d reset\n", id)
	}
	return errors.Join(failed...)
}

// outboxCell shortens s to one line of at most n bytes (a character cut whole) for a
// table cell, its control characters replaced with U+FFFD.
func outboxCell(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	// What a model or a payload wrote must not drive the terminal (escape sequences).
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return '\uFFFD'
		}
		return r
	}, s)
	if len(s) > n {
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		return s[:n] + "…"
	}
	return s
}
