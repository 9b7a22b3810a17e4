package onceflowtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// CommitFault makes commits of one job fail on purpose; see FailFirstCommit.
type CommitFault struct {
	db  *pgxpool.Pool
	seq string
}

// FailFirstCommit makes the first commit of job jobID on db fail, as a lost write or a
// failed statement would: Job.Commit and Job.CommitTx return a transient database error
// (SQLSTATE P0001, "onceflowtest: ... fails on purpose"), nothing of the commit is
// written, and the job is delivered again, so a test sees what its workflow does on the
// next delivery (a recorded step or tool call replayed, not run again; one effect). Every
// later commit of the job, and every other job's, goes through. Install it before the
// job can commit (before Env.Start, or before enqueuing it): a keyed job's id is
// onceflow.JobID(onceflow.EnqueueScope(tenant, kind, key)), or the id Enqueue returns.
//
// It works in PostgreSQL, so it holds for a worker in another process too: a trigger on
// job_completions counts the job's commits with a sequence, which a rollback does not
// undo. The trigger, its function and the sequence are dropped at cleanup.
func FailFirstCommit(t testing.TB, db *pgxpool.Pool, jobID string) *CommitFault {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	name := "onceflowtest_fail_commit_" + hex.EncodeToString(b[:])
	// The trigger gives its function the job id and the sequence's oid (so that it finds
	// the sequence whatever a session's search_path).
	install := fmt.Sprintf(`
CREATE SEQUENCE %[1]s;
CREATE FUNCTION %[1]s() RETURNS trigger LANGUAGE plpgsql AS $body$
BEGIN
    IF NEW.job_id = TG_ARGV[0] AND nextval(TG_ARGV[1]::oid::regclass) = 1 THEN
        RAISE EXCEPTION 'onceflowtest: the first commit of job %% fails on purpose', NEW.job_id;
    END IF;
    RETURN NEW;
END $body$;
DO $install$ BEGIN
    EXECUTE format('CREATE TRIGGER %[1]s BEFORE INSERT ON job_completions FOR EACH ROW EXECUTE FUNCTION %[1]s(%%L, %%L)',
        %[2]s, '%[1]s'::regclass::oid);
END $install$;`, name, quoteLiteral(jobID))
	if _, err := db.Exec(ctx, install, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatalf("onceflowtest: FailFirstCommit(%q): %v", jobID, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		drop := fmt.Sprintf(`DROP TRIGGER IF EXISTS %[1]s ON job_completions; DROP FUNCTION IF EXISTS %[1]s(); DROP SEQUENCE IF EXISTS %[1]s;`, name)
		if _, err := db.Exec(ctx, drop, pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Errorf("onceflowtest: remove the commit fault: %v", err)
		}
	})
	return &CommitFault{db: db, seq: name}
}

// Commits returns how many times job's commit was tried since FailFirstCommit: 1 means
// the failed one only, 2 the failed one and the one after it, and so on (a delivery that
// finds the job done by another counts too).
func (f *CommitFault) Commits(t testing.TB) int {
	t.Helper()
	var n int64
	var called bool
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.db.QueryRow(ctx, `SELECT last_value, is_called FROM `+f.seq).Scan(&n, &called); err != nil {
		t.Fatalf("onceflowtest: read the commit fault: %v", err)
	}
	if !called {
		return 0
	}
	return int(n)
}

// quoteLiteral returns s as a PostgreSQL string literal (standard_conforming_strings,
// on by default since PostgreSQL 9.1: only the quote is doubled).
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
