package onceflow

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/queue"
)

// Resolution is an operator's decision on a tool call in doubt (Inspector.ResolveInDoubt).
type Resolution struct {
	// Happened says the call's effect took place (the operator checked the downstream
	// system): its Result is recorded as the tool's result and the job, run again,
	// continues from it without calling the tool. False says it did not: the intent is
	// removed and the job, run again, calls the tool.
	Happened bool
	// Result is the tool's result as the model will read it, when Happened.
	Result string
}

// InDoubtJob is a job in doubt, with its calls (Inspector.InDoubt).
type InDoubtJob struct {
	Tenant string        `json:"tenant"`
	JobID  string        `json:"job_id"`
	Calls  []InDoubtCall `json:"calls"`
}

// InDoubt lists up to limit jobs with tool calls in doubt, across tenants, oldest first:
// the operators' list (onceflow indoubt list, the operator UI). It needs Config.DB.
func (in *Inspector) InDoubt(ctx context.Context, limit int) ([]InDoubtJob, error) {
	s := in.c.steps
	if s == nil {
		return nil, errors.New("onceflow: InDoubt: Config.DB is required (the job_steps table is in PostgreSQL)")
	}
	rows, err := s.db.Query(ctx, `
SELECT tenant, job_id, tool, arguments, substr(name, 6), created_at FROM job_steps
WHERE state = 'intent' AND (tenant, job_id) IN (
	SELECT tenant, job_id FROM job_steps WHERE state = 'intent'
	GROUP BY tenant, job_id ORDER BY min(created_at) LIMIT $1)
ORDER BY created_at, tenant, job_id, name`, max(limit, 1))
	if err != nil {
		return nil, fmt.Errorf("onceflow: list the jobs in doubt: %w", err)
	}
	var out []InDoubtJob
	at := map[[2]string]int{}
	for rows.Next() {
		var tenant, job string
		var c InDoubtCall
		if err := rows.Scan(&tenant, &job, &c.Tool, &c.Arguments, &c.Key, &c.StartedAt); err != nil {
			rows.Close()
			return nil, fmt.Errorf("onceflow: list the jobs in doubt: %w", err)
		}
		i, ok := at[[2]string{tenant, job}]
		if !ok {
			i = len(out)
			at[[2]string{tenant, job}] = i
			out = append(out, InDoubtJob{Tenant: tenant, JobID: job})
		}
		out[i].Calls = append(out[i].Calls, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflow: list the jobs in doubt: %w", err)
	}
	return out, nil
}

// ResolveInDoubt records an operator's decision on the tool call key of tenant's job id,
// in doubt (StatusInDoubt), and, once no call of the job is left in doubt, puts the job
// back on its queue from the dead-letter queue (the same job id) so it continues: from
// the recorded result when the call happened, calling the tool again when it did not.
// A key that is not in doubt, or another tenant's job's, gives ErrNotInDoubt; an
// invalid job id is ErrJobNotFound. When the decision is recorded but the job has no dead letter to replay
// (it was purged, or replayed already), the error says so and the decision stands.
func (in *Inspector) ResolveInDoubt(ctx context.Context, tenant, id, key string, r Resolution) error {
	s := in.c.steps
	if s == nil {
		return errors.New("onceflow: ResolveInDoubt: Config.DB is required (the job_steps table is in PostgreSQL)")
	}
	if !queue.ValidJobID(id) {
		return ErrJobNotFound
	}
	name := toolStepPrefix + key
	var left int
	err := pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		var tag interface{ RowsAffected() int64 }
		var err error
		if r.Happened {
			tag, err = tx.Exec(ctx, `UPDATE job_steps SET state = 'done', result = $4, expires_at = greatest(expires_at, now() + $5::bigint * interval '1 microsecond'), created_at = now()
WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'intent'`, tenant, id, name, []byte(r.Result), s.retention.Microseconds())
		} else {
			tag, err = tx.Exec(ctx, `DELETE FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3 AND state = 'intent'`, tenant, id, name)
		}
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return ErrNotInDoubt
		}
		return tx.QueryRow(ctx, `SELECT count(*) FROM job_steps WHERE tenant = $1 AND job_id = $2 AND state = 'intent'`, tenant, id).Scan(&left)
	})
	if errors.Is(err, ErrNotInDoubt) {
		// A retry of a resolution whose job could not be put back (Redis did not answer):
		// the same decision is recorded, no call is left in doubt, and the dead letter is
		// still there. Put the job back now.
		// The dead letter must be the job's in doubt on this very call.
		inDoubtOnKey := func(d *queue.DeadLetter) bool {
			return strings.Contains(d.Reason, ErrInDoubt.Error()) && strings.Contains(d.Reason, "(key "+key+")")
		}
		if same, left, rerr := in.resolvedAs(ctx, tenant, id, name, r); rerr == nil && same && left == 0 {
			if rerr := in.replayDead(ctx, tenant, id, inDoubtOnKey); rerr == nil {
				return nil
			} else if !errors.Is(rerr, ErrJobNotFound) {
				return fmt.Errorf("onceflow: job %s: the decision is recorded; putting the job back failed, retry: %w", id, rerr)
			}
		}
		return fmt.Errorf("%w: job %s, key %s", ErrNotInDoubt, id, key)
	}
	if err != nil {
		return fmt.Errorf("onceflow: resolve job %s's call %s: %w", id, key, err)
	}
	if left > 0 {
		return nil // the job waits for the operator's decision on its other calls
	}
	if err := in.replayDead(ctx, tenant, id, nil); err != nil && !errors.Is(err, ErrJobNotFound) {
		return fmt.Errorf("onceflow: job %s: the decision is recorded; putting the job back failed, retry the same decision: %w", id, err)
	} else if err != nil {
		return err
	}
	return nil
}

// resolvedAs reports whether the call name of tenant's job id is resolved as r says (a
// result recorded equal to r.Result when it happened; no record when it did not), and
// how many of the job's calls are still in doubt.
func (in *Inspector) resolvedAs(ctx context.Context, tenant, id, name string, r Resolution) (same bool, left int, err error) {
	var state *string
	var result []byte
	err = in.c.steps.db.QueryRow(ctx, `SELECT (SELECT state FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3),
	(SELECT result FROM job_steps WHERE tenant = $1 AND job_id = $2 AND name = $3),
	(SELECT count(*) FROM job_steps WHERE tenant = $1 AND job_id = $2 AND state = 'intent')`, tenant, id, name).Scan(&state, &result, &left)
	if err != nil {
		return false, 0, err
	}
	if r.Happened {
		return state != nil && *state == "done" && string(result) == r.Result, left, nil
	}
	return state == nil, left, nil
}

// replayDead puts tenant's job id back on its queue from its latest dead letter, when
// match (nil: any) accepts it.
func (in *Inspector) replayDead(ctx context.Context, tenant, id string, match func(*queue.DeadLetter) bool) error {
	c := in.c
	for _, name := range c.stateQueues() {
		n, err := c.knownPartitions(ctx, name)
		if err != nil {
			return fmt.Errorf("onceflow: replay job %s: %w", id, err)
		}
		keys := c.jobKeys(name, id)
		for p := range max(n, 1) {
			found, err := queue.FindDead(ctx, c.rdb, keys.InPartition(p), id)
			if err != nil {
				return fmt.Errorf("onceflow: replay job %s: %w", id, err)
			}
			var latest *queue.DeadLetter
			for i := range found {
				if found[i].Tenant == tenant && (latest == nil || found[i].FailedAt.After(latest.FailedAt)) {
					latest = &found[i]
				}
			}
			if latest == nil || match != nil && !match(latest) {
				continue
			}
			if _, err := queue.Replay(ctx, c.rdb, keys.InPartition(p), latest.ID); err != nil {
				return fmt.Errorf("onceflow: replay job %s: %w", id, err)
			}
			return nil
		}
	}
	return fmt.Errorf("onceflow: job %s: the decision is recorded, but the job has no dead letter to replay (replay it yourself if it was purged): %w", id, ErrJobNotFound)
}
