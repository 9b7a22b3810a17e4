package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/config"
	"github.com/onceflow/onceflow/queue"
)

const dlqUsage = "list [--json] [--limit N] | replay ID|--all [--json] | purge ID|--all|--older-than DURATION [--json]\n" +
	"    [--queue NAME]\n\n" +
	"--queue names the queue (default: the program's only queue; the onceflow binary's is summaries).\n" +
	"ID is a dead-letter entry id (1700000000000-0, as `dlq list` shows) or a job id (a UUID: every\n" +
	"dead letter of that job). replay re-enqueues with the same job id and removes the dead letter\n" +
	"in one step; purge deletes it for good; purge --older-than deletes every dead letter that\n" +
	"failed more than DURATION ago (as the workers do after ONCEFLOW_DLQ_RETENTION)."

// streamID matches a Redis stream entry id.
var streamID = regexp.MustCompile(`^[0-9]{1,20}-[0-9]{1,20}$`)

// runDLQ inspects and acts on the service queue's dead letters.
func runDLQ(ctx context.Context, e *env, args []string) error {
	if err := checkSubcommand(e, "dlq", dlqUsage, args); err != nil {
		return err
	}
	sub := args[0]
	if sub != "list" && sub != "replay" && sub != "purge" {
		return usageErrorf("dlq: unknown subcommand %q; want list, replay or purge", sub)
	}
	fs := flags(e, "dlq", dlqUsage, config.GroupRedis, config.GroupJobs)
	loader := config.Register(fs)
	asJSON := fs.Bool("json", false, "machine-readable output on stdout")
	all := fs.Bool("all", false, "act on every dead letter (replay, purge)")
	limit := fs.Int("limit", 1000, "most dead letters to list")
	olderThan := fs.Duration("older-than", 0, "purge: every dead letter that failed more than this long ago")
	queueName := fs.String("queue", "", "the queue whose dead letters to act on (default: the program's only queue)")
	pos, err := parseInterspersed(fs, args[1:])
	if err != nil {
		return err
	}
	cfg, err := settings(e, loader)
	if err != nil {
		return err
	}
	keys, err := dlqKeys(e, cfg, *queueName)
	if err != nil {
		return err
	}
	rdb, err := newRedis(cfg)
	if err != nil {
		return err
	}
	defer rdb.Close()
	// Every partition that may hold dead letters: the configured ones, and more when the
	// queue had more before.
	n, err := queue.KnownPartitions(ctx, rdb, keys, cfg.QueuePartitions)
	if err != nil {
		return err
	}
	parts := keys.Partitions(n)

	if sub == "list" {
		if len(pos) > 0 || *all {
			return usageErrorf("dlq list takes no ID and no --all")
		}
		if *limit < 1 {
			return usageErrorf("dlq list: --limit must be at least 1")
		}
		return dlqList(ctx, e, rdb, parts, *limit, *asJSON)
	}
	if olderThanSet(fs) {
		switch {
		case sub != "purge":
			return usageErrorf("dlq %s: --older-than is for purge", sub)
		case *all || len(pos) > 0:
			return usageErrorf("dlq purge: give an ID, --all or --older-than, not several")
		case *olderThan <= 0:
			return usageErrorf("dlq purge: --older-than must be positive")
		}
		return dlqPurgeOlder(ctx, e, rdb, parts, *olderThan, cfg.ResultTTL, *asJSON)
	}
	switch {
	case *all && len(pos) > 0:
		return usageErrorf("dlq %s: give an ID or --all, not both", sub)
	case !*all && len(pos) != 1:
		return usageErrorf("dlq %s: give one ID (a dead-letter entry id or a job id) or --all", sub)
	case !*all && !streamID.MatchString(pos[0]) && !queue.ValidJobID(pos[0]):
		return usageErrorf("dlq %s: %q is neither a dead-letter entry id (1700000000000-0) nor a job id (printable ASCII without spaces)", sub, pos[0])
	}
	targets, err := dlqTargets(ctx, rdb, parts, pos, *all)
	if err != nil {
		return err
	}
	return dlqAct(ctx, e, rdb, keys, sub, targets, cfg.ResultTTL, *asJSON)
}

// parseInterspersed parses flags that may come before or after positional arguments
// and returns the positional ones.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := parse(fs, args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// dlqList prints up to limit dead letters, oldest first (of the oldest limit of each
// partition).
func dlqList(ctx context.Context, e *env, rdb redis.Cmdable, parts []queue.Keys, limit int, asJSON bool) error {
	var dead []queue.DeadLetter
	for _, keys := range parts {
		var got []queue.DeadLetter
		for start := "-"; start != "" && len(got) < limit; {
			page, next, err := queue.ListDead(ctx, rdb, keys, start, int64(min(500, limit-len(got))))
			if err != nil {
				return err
			}
			got, start = append(got, page...), next
		}
		dead = append(dead, got...)
	}
	slices.SortStableFunc(dead, func(a, b queue.DeadLetter) int { return a.FailedAt.Compare(b.FailedAt) })
	dead = dead[:min(len(dead), limit)]
	if asJSON {
		if dead == nil {
			dead = []queue.DeadLetter{}
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(dead)
	}
	if len(dead) == 0 {
		fmt.Fprintln(e.stdout, "no dead letters")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	partition := func(d queue.DeadLetter) string { return "" }
	if len(parts) > 1 {
		fmt.Fprint(tw, "PARTITION\t")
		partition = func(d queue.DeadLetter) string { return strconv.Itoa(d.Partition) + "\t" }
	}
	fmt.Fprintln(tw, "DEAD ID\tJOB ID\tTENANT\tDELIVERIES\tFAILED AT\tREASON")
	for _, d := range dead {
		fmt.Fprintf(tw, "%s%s\t%s\t%s\t%d\t%s\t%s\n", partition(d), d.ID, dash(d.JobID), dash(d.Tenant), d.Deliveries,
			d.FailedAt.UTC().Format(time.RFC3339), oneLine(d.Reason))
	}
	return tw.Flush()
}

// dlqTargets resolves the dead letters to act on, in every partition parts: every one
// (--all, a snapshot, so that jobs dead-lettered again meanwhile are not looped over),
// one entry id (an error when two partitions have one of that id: the job id tells
// them apart), or every dead letter of a job id.
func dlqTargets(ctx context.Context, rdb redis.Cmdable, parts []queue.Keys, pos []string, all bool) ([]queue.DeadLetter, error) {
	var out []queue.DeadLetter
	for _, keys := range parts {
		switch {
		case all:
			for start := "-"; start != ""; {
				page, next, err := queue.ListDead(ctx, rdb, keys, start, 500)
				if err != nil {
					return nil, err
				}
				out, start = append(out, page...), next
			}
		case queue.ValidJobID(pos[0]):
			found, err := queue.FindDead(ctx, rdb, keys, pos[0])
			if err != nil {
				return nil, err
			}
			out = append(out, found...)
		default:
			page, _, err := queue.ListDead(ctx, rdb, keys, pos[0], 1)
			if err != nil {
				return nil, err
			}
			if len(page) == 1 && page[0].ID == pos[0] {
				out = append(out, page[0])
			}
		}
	}
	switch {
	case all:
		return out, nil
	case queue.ValidJobID(pos[0]):
		if len(out) == 0 {
			return nil, fmt.Errorf("job %s has no dead letter", pos[0])
		}
		return out, nil
	case len(out) > 1:
		return nil, fmt.Errorf("dead letter %s is in %d partitions of the queue: give the job id (%s or %s) instead", pos[0], len(out), dash(out[0].JobID), dash(out[1].JobID))
	case len(out) == 0:
		return []queue.DeadLetter{{ID: pos[0]}}, nil // the action reports it missing
	}
	return out, nil
}

// dlqResult is one line of replay/purge output.
type dlqResult struct {
	DeadID  string `json:"dead_id"`
	JobID   string `json:"job_id,omitempty"`
	EntryID string `json:"entry_id,omitempty"` // replay: the new stream entry
	// RetiredBy (replay) is the dead letter of the same job whose replay already
	// removed this one.
	RetiredBy string `json:"retired_by,omitempty"`
	Error     string `json:"error,omitempty"`
}

// dlqAct replays or purges targets and reports each; it fails (exit 1) when any failed.
func dlqAct(ctx context.Context, e *env, rdb redis.Cmdable, keys queue.Keys, sub string, targets []queue.DeadLetter, ttl time.Duration, asJSON bool) error {
	results := make([]dlqResult, 0, len(targets))
	replayed := map[string]string{} // job id -> the dead letter replayed for it
	// A job dead in several partitions (accepted twice across a change of the queue's
	// partitions) is replayed once, from the partition of its newest dead letter; its
	// dead letters in the others are retired by purging them.
	newest := map[string]queue.DeadLetter{}
	for _, d := range targets {
		if n, ok := newest[d.JobID]; d.JobID != "" && (!ok || d.FailedAt.After(n.FailedAt)) {
			newest[d.JobID] = d
		}
	}
	failed := 0
	for _, d := range targets {
		r := dlqResult{DeadID: d.ID, JobID: d.JobID}
		var err error
		if n := newest[d.JobID]; sub == "replay" && d.JobID != "" && n.Partition != d.Partition {
			if err = queue.Purge(ctx, rdb, keys.InPartition(d.Partition), d.ID, ttl); err == nil {
				r.RetiredBy = n.ID
			}
		} else if sub == "replay" {
			r.EntryID, err = queue.Replay(ctx, rdb, keys.InPartition(d.Partition), d.ID)
			if errors.Is(err, queue.ErrDeadLetterNotFound) && replayed[d.JobID] != "" {
				// The replay of this job's other dead letter retired this one (the
				// enqueue retires the dead letter the job index points at).
				r.RetiredBy, err = replayed[d.JobID], nil
			} else if err == nil && d.JobID != "" {
				replayed[d.JobID] = d.ID
			}
		} else {
			err = queue.Purge(ctx, rdb, keys.InPartition(d.Partition), d.ID, ttl)
		}
		if err != nil {
			failed++
			r.Error = err.Error()
		}
		results = append(results, r)
		if asJSON {
			continue
		}
		switch {
		case err != nil:
			fmt.Fprintf(e.stderr, "onceflow: dlq %s %s: %v\n", sub, d.ID, err)
		case r.RetiredBy != "":
			fmt.Fprintf(e.stdout, "retired %s by the replay of %s (job %s)\n", d.ID, r.RetiredBy, d.JobID)
		case sub == "replay":
			fmt.Fprintf(e.stdout, "replayed %s as %s (job %s)\n", d.ID, r.EntryID, dash(d.JobID))
		default:
			fmt.Fprintf(e.stdout, "purged %s\n", d.ID)
		}
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(results); err != nil {
			return err
		}
	} else if len(targets) == 0 {
		fmt.Fprintln(e.stdout, "no dead letters")
	}
	if failed > 0 {
		return fmt.Errorf("dlq %s: %d of %d failed", sub, failed, len(targets))
	}
	return nil
}

// olderThanSet reports whether --older-than was given.
func olderThanSet(fs *flag.FlagSet) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == "older-than" })
	return set
}

// dlqPurgeOlder deletes the dead letters of every partition parts that failed more
// than age ago (queue.TrimDead; their job indexes get ttl) and prints how many.
func dlqPurgeOlder(ctx context.Context, e *env, rdb redis.Cmdable, parts []queue.Keys, age, ttl time.Duration, asJSON bool) error {
	before := time.Now().Add(-age)
	var n int64
	for _, keys := range parts {
		got, err := queue.TrimDead(ctx, rdb, keys, before, ttl)
		n += got
		if err != nil {
			return fmt.Errorf("dlq purge --older-than %s: %w (%d deleted before the error)", age, err, n)
		}
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Purged int64     `json:"purged"`
			Before time.Time `json:"before"`
		}{n, before.UTC()})
	}
	fmt.Fprintf(e.stdout, "purged %d dead letters older than %s (failed before %s)\n", n, age, before.UTC().Format(time.RFC3339))
	return nil
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// dlqRetention maps ONCEFLOW_DLQ_RETENTION to WorkerConfig.DeadLetterRetention: 0 (keep
// for ever) is negative there, where 0 means the default.
func dlqRetention(c *config.Config) time.Duration {
	if c.DLQRetention == 0 {
		return -1
	}
	return c.DLQRetention
}

// dlqKeys names the queue --queue selects: any valid name; without it the only queue of
// the program's workflows (a usage error when they have several, or none).
func dlqKeys(e *env, cfg *config.Config, name string) (queue.Keys, error) {
	keys := queue.Keys{Prefix: cfg.Prefix, Queue: name}
	if name != "" {
		if err := keys.Validate(); err != nil {
			return queue.Keys{}, usageErrorf("--queue: %v", err)
		}
		return keys, nil
	}
	wfs, err := e.workflows(e.host(cfg, newLogger(e.stderr, cfg.LogFormat), nil))
	if err != nil {
		return queue.Keys{}, err
	}
	switch qs := workflowQueues(wfs); len(qs) {
	case 1:
		keys.Queue = qs[0]
		return keys, nil
	case 0:
		return queue.Keys{}, usageErrorf("dlq: give --queue NAME (this program hosts no queues)")
	default:
		return queue.Keys{}, usageErrorf("dlq: give --queue, one of: %s", strings.Join(qs, ", "))
	}
}
