package queue

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/prometheus/client_golang/prometheus"
)

// slowRuns is a handler that takes d per run and records who ran what.
type slowRuns struct {
	d    time.Duration
	mu   sync.Mutex
	runs []string // "worker:deliveries", in start order
	done int
}

func (s *slowRuns) handler(worker string) Handler {
	return HandlerFunc(func(ctx context.Context, j *Job) error {
		s.mu.Lock()
		s.runs = append(s.runs, worker)
		s.mu.Unlock()
		select {
		case <-time.After(s.d):
		case <-ctx.Done():
			return ctx.Err()
		}
		s.mu.Lock()
		s.done++
		s.mu.Unlock()
		return nil
	})
}

func (s *slowRuns) snapshot() ([]string, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.runs...), s.done
}

// A handler that runs 3x ClaimIdle keeps its message while its worker lives, because the
// worker renews the lease; a second worker watching for idle entries never gets it.
func TestLeaseRenewalKeepsSlowJob(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	const claimIdle = 600 * time.Millisecond
	s := &slowRuns{d: 3 * claimIdle}
	reg := prometheus.NewRegistry()
	a := start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "a", ClaimIdle: claimIdle, RenewInterval: claimIdle / 4, Handler: s.handler("a"), Registerer: reg})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "a to start the job", func() bool { r, _ := s.snapshot(); return len(r) == 1 })
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "b", ClaimIdle: claimIdle, ClaimInterval: 20 * time.Millisecond, Handler: s.handler("b")})
	testenv.WaitFor(t, 15*time.Second, "the run to finish", func() bool { _, d := s.snapshot(); return d == 1 })
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	time.Sleep(claimIdle) // b would have had every chance by now
	runs, done := s.snapshot()
	if len(runs) != 1 || runs[0] != "a" || done != 1 {
		t.Errorf("runs %v (done %d), want only a's", runs, done)
	}
	if got := metricValue(t, reg, "onceflow_queue_lease_renewals_total"); got < 5 {
		t.Errorf("%v lease renewals during a run of 12 renew intervals", got)
	}
	if got := metricValue(t, reg, "onceflow_queue_leases_lost_total"); got != 0 {
		t.Errorf("%v leases lost", got)
	}
	_ = a
}

// Without renewal the same slow run is reclaimed by the second worker after ClaimIdle,
// and both runs happen: the at-least-once cost that renewal avoids.
func TestWithoutLeaseRenewalSlowJobRunsTwice(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	const claimIdle = 600 * time.Millisecond
	s := &slowRuns{d: 3 * claimIdle}
	// a never reclaims anything itself (ClaimIdle 1h) and does not renew.
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "a", ClaimIdle: time.Hour, RenewInterval: -1, Handler: s.handler("a")})
	enqueue(t, rdb, keys, message(1, nil))
	testenv.WaitFor(t, 10*time.Second, "a to start the job", func() bool { r, _ := s.snapshot(); return len(r) == 1 })
	start(t, WorkerConfig{Redis: rdb, Keys: keys, Consumer: "b", ClaimIdle: claimIdle, ClaimInterval: 20 * time.Millisecond, Handler: s.handler("b")})
	testenv.WaitFor(t, 20*time.Second, "both runs to finish", func() bool { _, d := s.snapshot(); return d == 2 })
	testenv.WaitFor(t, 5*time.Second, "the ack", func() bool { return len(pendingIDs(t, rdb, keys, DefaultGroup)) == 0 })
	runs, _ := s.snapshot()
	if len(runs) != 2 || runs[0] != "a" || runs[1] != "b" {
		t.Errorf("runs %v, want [a b]", runs)
	}
}

// Renewal never takes back an entry another consumer reclaimed: it reports it lost.
func TestRenewDoesNotStealReclaimedEntry(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	ctx := context.Background()
	if err := CreateGroup(ctx, rdb, keys, DefaultGroup); err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, rdb, keys, message(1, nil), message(2, nil))
	if err := rdb.XReadGroup(ctx, readArgs(keys, "a", 2)).Err(); err != nil {
		t.Fatal(err)
	}
	// b reclaims the first entry (as after a long pause of a's).
	if err := rdb.XClaim(ctx, claimArgs(keys, "b", ids[0])).Err(); err != nil {
		t.Fatal(err)
	}
	before := rdb.XPendingExt(ctx, pendingArgs(keys)).Val()
	lost, deleted, err := renew(ctx, rdb, keys, DefaultGroup, "a", ids, make([]time.Time, len(ids)))
	if err != nil {
		t.Fatal(err)
	}
	if len(lost) != 1 || lost[0] != ids[0] || len(deleted) != 0 {
		t.Errorf("lost %v deleted %v, want lost [%s]", lost, deleted, ids[0])
	}
	after := rdb.XPendingExt(ctx, pendingArgs(keys)).Val()
	for i, p := range after {
		if p.RetryCount != before[i].RetryCount {
			t.Errorf("entry %s: delivery count %d -> %d; renewal must not count as a delivery", p.ID, before[i].RetryCount, p.RetryCount)
		}
	}
	if after[0].Consumer != "b" || after[1].Consumer != "a" {
		t.Errorf("owners after renewal: %s, %s; want b, a", after[0].Consumer, after[1].Consumer)
	}
}
