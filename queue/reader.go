package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// How a Worker reads several partitions
//
// A Worker consumes the partitions WorkerConfig.Partitions names. It groups them by the
// Redis node that serves their hash slot (groupByNode) and runs one reader per node: every
// read of a reader carries all of its node's partitions in one round trip, and one
// acknowledger per node acknowledges their finished entries in one round trip (acker), so
// the round trips per job do not grow with the partitions a node holds. One Worker of
// several partitions, rather than one per partition under a coordinator, because a read
// that serves several partitions must decide how to divide its slots between them, and
// the one that holds the slots is the one that can: a coordinator merging the reads of
// independent workers would batch only those that happened to ask at the same moment.
//
//   - On a single Redis (any client but a cluster client) one node holds every partition,
//     and one XREADGROUP may name all their streams: the reader's read is one XREADGROUP
//     over them, blocking (BLOCK) like a one-partition worker's when every partition was
//     empty at its last read. COUNT applies to each stream, so such a read asks for the
//     same count of each, its free slots divided between them. Once a partition filled
//     what it was asked for (more may wait), the next read gives it a larger share
//     (shareReads): the partitions that came back short are asked for one each, the full
//     ones share the rest; that is two XREADGROUPs (one per count) in one pipeline, which
//     do not block (a blocking first one would hold up the second), or one XREADGROUP
//     when every count is the same, which blocks like the idle read.
//   - On a Redis Cluster an XREADGROUP over streams of several hash slots is refused
//     (CROSSSLOT), even when one node serves them all. The reader sends one XREADGROUP per
//     partition in one pipeline, which the cluster client sends to the node as one round
//     trip (go-redis' ClusterClient maps a pipeline's commands to the nodes that serve
//     their slots and sends each node its part concurrently, one write and one read per
//     node). Such a read does not block: a blocking command in a pipeline would hold up
//     the ones after it. While a partition filled its share at its last read, the reader
//     reads again at once; once every partition of the node came back short, it waits
//     for new entries with one blocking XREADGROUP per partition (COUNT 1, BLOCK up to
//     WorkerConfig.Block), each on a connection of its own and holding one slot, as an
//     idle one-partition worker does (await). The first of them to return an entry
//     dispatches it and wakes the reader, which goes back to pipelined reads; the others
//     keep waiting on their partitions until an entry or their BLOCK ends. So an idle
//     node costs what it did (one blocking read per partition per Block), and a busy one
//     a round trip per read whatever its partitions.
//
// With fewer free slots than partitions, a read serves the partitions not read for
// pollEvery first, then the full ones (shareReads), and the next read starts after the
// last one it served; a fetch keeps slots from its reclaim for the partitions due a read
// (reserved). While every slot of a shared budget (another node's reader, or another
// Worker's) is taken, a read or wait that would block does not: it reads once, and
// finding nothing gives its slots back for pollEvery (pauseRead).
//
// Reclaim scans of the node's partitions that are due are one pipeline too, before the
// read. The slot map a grouping comes from is the cluster client's (no round trip once
// it is loaded); a worker looks at it every regroupInterval and, when partitions moved
// between nodes (a resharding), stops its readers after their read in progress and starts
// them again on the new groups. A stale grouping is never wrong, only slower: the cluster
// client routes every command by its own map (reloaded when a node answers MOVED).

// part is one partition a Worker consumes: its keys, its logger, the acknowledger of its
// node, and the state of its reads and of its scheduled jobs' mover.
type part struct {
	keys   Keys
	stream string
	log    *slog.Logger
	// acks is the acknowledger of the node that serves the partition, set before a
	// reader of it starts (so every entry read from it finds one).
	acks atomic.Pointer[acker]

	// Owned by the reader of the partition's node; passed to the next reader only after
	// the previous one returned.
	cursor   string    // XAUTOCLAIM cursor
	lastScan time.Time // when its last XAUTOCLAIM scan reached the end
	full     bool      // its last read returned all it asked for: more may be waiting
	lastRead time.Time // when a read last asked it for entries (reader.read)
	waiting  bool      // a blocking read of it alone is outstanding (reader.wait)
	got      int       // the entries of the read under way (reader.read)

	// wake tells the partition's mover that the worker scheduled one of its jobs
	// (buffered 1); wakeAt is the earliest due time (Unix ns) the mover was woken for, 0
	// for none.
	wake   chan struct{}
	wakeAt atomic.Int64
}

func newPart(keys Keys, log *slog.Logger) *part {
	return &part{keys: keys, stream: keys.Stream(), log: log, cursor: "0-0", wake: make(chan struct{}, 1)}
}

// reclaimDue reports whether the partition's reclaim scan should run now: one is under
// way, or the last reached the end interval ago or more.
func (p *part) reclaimDue(interval time.Duration, now time.Time) bool {
	return p.cursor != "0-0" || now.Sub(p.lastScan) >= interval
}

// nodeGroup is the partitions one Redis node serves.
type nodeGroup struct {
	// key names the group's acknowledger: the node's address, "" for the one server of
	// a client that is not a cluster client, and "?P" for a partition P whose node is
	// unknown.
	key   string
	parts []*part
}

// groupByNode groups parts by the Redis node that serves their hash slot. On a Redis
// Cluster (a *redis.ClusterClient) that is the primary the client's slot map names for
// each partition's stream, read without a round trip once the map is loaded; a partition
// whose primary is unknown (the map cannot be loaded: the cluster is unreachable) is a
// group of its own, as every partition was read before they were grouped. Any other
// client talks to one server, which holds them all: one group. Groups come in the order
// of their first partition.
func groupByNode(ctx context.Context, rdb redis.UniversalClient, parts []*part) []nodeGroup {
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return []nodeGroup{{parts: parts}}
	}
	var groups []nodeGroup
	index := map[string]int{}
	for _, p := range parts {
		node, err := cc.MasterForKey(ctx, p.stream)
		if err != nil {
			groups = append(groups, nodeGroup{key: fmt.Sprintf("?%d", p.keys.Partition), parts: []*part{p}})
			continue
		}
		addr := node.Options().Addr
		if i, ok := index[addr]; ok {
			groups[i].parts = append(groups[i].parts, p)
			continue
		}
		index[addr] = len(groups)
		groups = append(groups, nodeGroup{key: addr, parts: []*part{p}})
	}
	return groups
}

// sameGroups reports whether a and b group the same partitions under the same keys.
func sameGroups(a, b []nodeGroup) bool {
	return slices.EqualFunc(a, b, func(x, y nodeGroup) bool { return x.key == y.key && slices.Equal(x.parts, y.parts) })
}

// regroupInterval is how often a worker of several partitions on a Redis Cluster compares
// its grouping with the cluster client's slot map.
var regroupInterval = 5 * time.Second

// readLoop reads the worker's partitions, one reader per node group, and hands what they
// read to handler goroutines until ctx is cancelled; it returns once every reader
// returned (their reads in progress complete, and what they read is dispatched).
func (w *Worker) readLoop(ctx, hctx context.Context) {
	_, cluster := w.rdb.(*redis.ClusterClient)
	for {
		gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		groups := groupByNode(gctx, w.rdb, w.parts)
		cancel()
		// The slots are shared when another reader takes from them: one of another node,
		// or another Worker's on the same Budget.
		w.shared.Store(w.cfg.Budget != nil || len(groups) > 1)
		rctx, stop := context.WithCancel(ctx)
		var readers sync.WaitGroup
		for _, g := range groups {
			a := w.ackerFor(g.key)
			for _, p := range g.parts {
				p.acks.Store(a)
			}
			r := newReader(w, g, !cluster || len(g.parts) == 1)
			readers.Go(func() { r.loop(rctx, hctx) })
		}
		moved := cluster && len(w.parts) > 1 && w.watchGroups(ctx, groups)
		if !moved {
			<-ctx.Done()
		}
		stop()
		readers.Wait()
		if !moved {
			return
		}
	}
}

// watchGroups compares groups with the cluster client's slot map every regroupInterval;
// it reports true when they differ, false when ctx is cancelled first.
func (w *Worker) watchGroups(ctx context.Context, groups []nodeGroup) bool {
	t := time.NewTicker(regroupInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
		gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		now := groupByNode(gctx, w.rdb, w.parts)
		cancel()
		if !sameGroups(groups, now) {
			w.log.Info("the cluster's slot map moved partitions between nodes: reading them by their new nodes", "groups", len(now))
			return true
		}
	}
}

// ackerFor returns the acknowledger of node group key, starting it on first use. Every
// acknowledger lives until Run returns (closeAckers): a handler may still hold the one
// its partition had before a regrouping.
func (w *Worker) ackerFor(key string) *acker {
	w.ackMu.Lock()
	defer w.ackMu.Unlock()
	if a, ok := w.ackers[key]; ok {
		return a
	}
	a := newAcker(w.rdb, w.cfg.Group, w.cfg.AckBatch, w.cfg.AckLinger, w.log, w.m)
	go a.run()
	w.ackers[key] = a
	return a
}

// closeAckers closes every acknowledger: each acknowledges what it holds first.
func (w *Worker) closeAckers() {
	w.ackMu.Lock()
	as := make([]*acker, 0, len(w.ackers))
	for _, a := range w.ackers {
		as = append(as, a)
	}
	w.ackMu.Unlock()
	for _, a := range as {
		a.close()
	}
}

// reader reads the partitions of one node group (see the top of this file).
type reader struct {
	w     *Worker
	parts []*part
	// multiKey: one XREADGROUP may name every stream of the group (not a cluster, or
	// one partition).
	multiKey bool
	byStream map[string]*part
	// The rotations of which partitions a read, a reclaim and a wait short of slots
	// serve first, one each so that every one of them turns through all the partitions
	// (rotated); rot is the rotated order's buffer.
	nextRead, nextClaim, nextWait int
	rot                           []*part
	// pause: the last read did not block because every slot of a shared budget was
	// taken; when it returned nothing, the loop waits pollEvery without its slots before
	// reading again (pauseRead). claimed: the last fetch reclaimed entries.
	pause, claimed bool
	// woke receives the end of each blocking read of one partition (wait); buffered for
	// one per partition, and a partition has at most one outstanding.
	woke    chan wakeup
	waiters sync.WaitGroup
}

// wakeup is the end of one partition's blocking read: whether it delivered an entry,
// and its error.
type wakeup struct {
	p   *part
	got bool
	err error
}

func newReader(w *Worker, g nodeGroup, multiKey bool) *reader {
	r := &reader{w: w, parts: g.parts, multiKey: multiKey, byStream: make(map[string]*part, len(g.parts)),
		woke: make(chan wakeup, len(g.parts))}
	for _, p := range g.parts {
		r.byStream[p.stream] = p
	}
	return r
}

// loop reads until ctx is cancelled, then waits for its outstanding blocking reads.
func (r *reader) loop(ctx, hctx context.Context) {
	w := r.w
	defer r.settleWaiters()
	var b backoff
	for {
		if err := r.noteWakeups(); err != nil && !r.retry(ctx, &b, err) {
			return
		}
		limit, ok := w.admit(ctx)
		if !ok {
			return
		}
		if !r.multiKey && !r.hot() && !r.reclaimDue(time.Now()) {
			// Every partition came back short at its last read: wait for new entries.
			ok, err := r.await(ctx, hctx, limit)
			switch {
			case !ok:
				return
			case err != nil:
				if !r.retry(ctx, &b, err) {
					return
				}
			default:
				b.reset()
			}
			continue
		}
		n := w.acquire(ctx, r.hot(), len(r.parts))
		if n == 0 {
			return
		}
		if limit > 0 && n > limit {
			w.release(n - limit)
			n = limit
		}
		batch, err := r.fetch(ctx, n)
		w.release(n - len(batch))
		for _, d := range batch {
			w.deliver(hctx, d)
		}
		if len(batch) == 0 && err == nil && r.pause && !pauseRead(ctx) {
			return
		}
		if err != nil {
			if !r.retry(ctx, &b, err) {
				return
			}
			continue
		}
		b.reset()
	}
}

// sharedBudgetFull reports whether every slot is taken of a budget other readers share
// (another node's reader, or another Worker's): a read or wait must then not block on
// the slots it holds (pauseRead).
func (w *Worker) sharedBudgetFull() bool { return w.shared.Load() && len(w.slots) == cap(w.slots) }

// pauseRead waits pollEvery, or returns false when ctx ends first. A read that would
// block while every slot of a shared budget is taken waits here instead, holding no
// slot: a blocking read's timeout is only as precise as the server's clock tick (hz: 100
// ms by default), and the slot it held would be out of reach of the other readers and
// workers for that long.
func pauseRead(ctx context.Context) bool { return sleepFor(ctx, pollEvery) }

// retry logs a failed read and sleeps its backoff; false when ctx was cancelled.
func (r *reader) retry(ctx context.Context, b *backoff, err error) bool {
	r.w.log.Warn("reading the queue failed; retrying", "err", err)
	return b.sleep(ctx)
}

// hot reports whether a partition filled what its last read asked for.
func (r *reader) hot() bool {
	return slices.ContainsFunc(r.parts, func(p *part) bool { return p.full })
}

// reclaimDue reports whether a partition's reclaim scan is due.
func (r *reader) reclaimDue(now time.Time) bool {
	return slices.ContainsFunc(r.parts, func(p *part) bool { return p.reclaimDue(r.w.cfg.ClaimInterval, now) })
}

// rotated returns the group's partitions from the rotation next's partition on, and
// advances next. The slice is reused by the next call.
func (r *reader) rotated(next *int) []*part {
	k := *next % len(r.parts)
	*next = k + 1
	r.rot = append(append(r.rot[:0], r.parts[k:]...), r.parts[:k]...)
	return r.rot
}

// fetch returns up to n deliveries of the group's partitions: reclaimed entries first
// (of the partitions whose scan is due), then new ones. It returns what it got even with
// an error.
func (r *reader) fetch(ctx context.Context, n int) ([]delivery, error) {
	// A read in progress completes even if ctx is cancelled meanwhile: the entries it
	// returns are pending to this consumer, and are run within the shutdown timeout.
	rctx := context.WithoutCancel(ctx)
	keep := r.reserved(n, time.Now())
	out, err := r.reclaim(rctx, n-keep)
	r.claimed = len(out) > 0
	if err != nil {
		return out, err
	}
	rest := n - len(out)
	if rest == 0 || ctx.Err() != nil {
		return out, nil
	}
	if !r.multiKey && !r.hot() && len(out) == 0 && keep == 0 {
		return out, nil // nothing waits that a blocking read (await) would not see
	}
	got, err := r.read(rctx, rest, len(out) > 0)
	return append(out, got...), err
}

// reserved returns how many of n slots a fetch at now keeps from its reclaim for the
// partitions due a read (not read for pollEvery): one each, up to half of them, and all
// of a single slot when the last fetch reclaimed. So a partition working through a
// backlog of entries to reclaim (due again at every fetch until its scan reaches the
// end) does not hold back the other partitions' new entries.
func (r *reader) reserved(n int, now time.Time) int {
	due := 0
	for _, p := range r.parts {
		if !p.waiting && now.Sub(p.lastRead) >= pollEvery { // a waiting one sees new entries
			due++
		}
	}
	switch {
	case due == 0:
		return 0
	case n == 1:
		if r.claimed {
			return 1
		}
		return 0
	}
	return min(due, n/2)
}

// reclaim claims up to n entries idle for ClaimIdle of the partitions whose scan is due,
// in one round trip (a pipeline of reclaimScript, one per partition; a script Redis has
// not cached is sent again with its text). n is divided between them; those that get
// no share are due again next time.
func (r *reader) reclaim(ctx context.Context, n int) ([]delivery, error) {
	w := r.w
	if n <= 0 {
		return nil, nil
	}
	now := time.Now()
	var due []*part
	for _, p := range r.rotated(&r.nextClaim) {
		if p.reclaimDue(w.cfg.ClaimInterval, now) && len(due) < n {
			due = append(due, p)
		}
	}
	switch len(due) {
	case 0:
		return nil, nil
	case 1:
		return w.reclaim(ctx, due[0], n)
	}
	counts := shareReads(n, make([]bool, len(due)), nil, 0)
	cmds := make([]*redis.Cmd, len(due))
	for try := 0; try < 2; try++ {
		_, _ = w.rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for i, p := range due {
				if try > 0 && !isNoScript(cmds[i].Err()) {
					continue
				}
				keys, args := w.reclaimCall(p, counts[i])
				if try == 0 {
					cmds[i] = reclaimScript.EvalSha(ctx, pipe, keys, args...)
				} else {
					cmds[i] = reclaimScript.Eval(ctx, pipe, keys, args...)
				}
			}
			return nil
		})
		if !slices.ContainsFunc(cmds, func(c *redis.Cmd) bool { return isNoScript(c.Err()) }) {
			break
		}
	}
	var out []delivery
	var first error
	for i, p := range due {
		res, err := cmds[i].Slice()
		var got []delivery
		if err == nil {
			got, err = w.claimed(ctx, p, res)
		} else {
			err = w.reclaimFailed(p, err)
		}
		out = append(out, got...)
		first = firstErr(first, err)
	}
	return out, first
}

// firstErr returns a when it is not nil, else b.
func firstErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// read reads up to n new entries of the group's partitions in one round trip; noBlock
// when reclaimed entries wait to run.
func (r *reader) read(ctx context.Context, n int, noBlock bool) ([]delivery, error) {
	w := r.w
	parts := r.rotated(&r.nextRead)
	now := time.Now()
	counts := r.shares(parts, n, now)
	// A read that serves some of the partitions only: the next one starts after them
	// (rotated moved on by one), so that a turn takes as many reads as it needs.
	served := 0
	for _, c := range counts {
		if c > 0 {
			served++
		}
	}
	if served < len(parts) {
		r.nextRead += max(served, 1) - 1
	}
	block := time.Duration(-1)
	r.pause = false
	if r.multiKey && !noBlock && !r.hot() && uniform(counts) {
		block = w.cfg.Block
		switch {
		case w.sharedBudgetFull():
			// Every slot of the shared budget is taken: another reader may have a
			// backlog waiting for the slots this read holds. Do not block on them.
			block = -1
			r.pause = true
		case slices.Contains(counts, 0):
			// Too few slots for every partition: the others are read within this.
			block = min(block, contendedBlock)
		}
	}
	var cmds []*redis.XStreamSliceCmd
	if r.multiKey {
		// One XREADGROUP per count (COUNT applies to each stream it names).
		var sizes []int
		for _, c := range counts {
			if c > 0 && !slices.Contains(sizes, c) {
				sizes = append(sizes, c)
			}
		}
		args := make([]*redis.XReadGroupArgs, len(sizes))
		for i, size := range sizes {
			var streams []string
			for j, p := range parts {
				if counts[j] == size {
					streams = append(streams, p.stream)
				}
			}
			for range len(streams) {
				streams = append(streams, ">")
			}
			args[i] = &redis.XReadGroupArgs{Group: w.cfg.Group, Consumer: w.cfg.Consumer, Streams: streams, Count: int64(size), Block: block}
		}
		cmds = r.send(ctx, args)
	} else {
		var args []*redis.XReadGroupArgs
		for j, p := range parts {
			if counts[j] > 0 {
				args = append(args, &redis.XReadGroupArgs{Group: w.cfg.Group, Consumer: w.cfg.Consumer,
					Streams: []string{p.stream, ">"}, Count: int64(counts[j]), Block: -1})
			}
		}
		cmds = r.send(ctx, args)
	}
	for j, p := range parts {
		p.got = 0
		if counts[j] > 0 {
			p.lastRead = now
		}
	}
	var out []delivery
	var first error
	for _, cmd := range cmds {
		res, err := cmd.Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			w.m.redisError("read")
			if isNoGroup(err) {
				w.recreateGroups(r.partsOf(cmd)...)
			}
			first = firstErr(first, fmt.Errorf("read new messages: %w", err))
			continue
		}
		for _, s := range res {
			p := r.byStream[s.Stream]
			if p == nil {
				continue // not one of ours: cannot happen
			}
			p.got += len(s.Messages)
			for _, m := range s.Messages {
				out = append(out, delivery{p: p, id: m.ID, fields: m.Values, deliveries: 1})
			}
		}
	}
	if first == nil {
		for j, p := range parts {
			if counts[j] > 0 {
				p.full = p.got >= counts[j]
			}
		}
	}
	return out, first
}

// send sends one XREADGROUP per args in one round trip: alone, or in a pipeline.
func (r *reader) send(ctx context.Context, args []*redis.XReadGroupArgs) []*redis.XStreamSliceCmd {
	cmds := make([]*redis.XStreamSliceCmd, len(args))
	if len(args) == 1 {
		cmds[0] = r.w.rdb.XReadGroup(ctx, args[0])
		return cmds
	}
	_, _ = r.w.rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for i, a := range args {
			cmds[i] = pipe.XReadGroup(ctx, a)
		}
		return nil
	})
	return cmds
}

// partsOf returns the partitions whose streams cmd (an XREADGROUP) names.
func (r *reader) partsOf(cmd redis.Cmder) []*part {
	var out []*part
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok {
			if p := r.byStream[s]; p != nil {
				out = append(out, p)
			}
		}
	}
	return out
}

// shares returns what a read of n slots at now asks of each of parts (in that order):
// on a single Redis, when no partition filled its last read, the same count of as many
// of them as n allows (one blocking XREADGROUP: COUNT applies to every stream it names);
// otherwise shareReads, with the partitions not read for pollEvery due first.
func (r *reader) shares(parts []*part, n int, now time.Time) []int {
	hot := make([]bool, len(parts))
	due := make([]bool, len(parts))
	for i, p := range parts {
		hot[i] = p.full
		due[i] = now.Sub(p.lastRead) >= pollEvery
	}
	if !r.multiKey || slices.Contains(hot, true) {
		return shareReads(n, hot, due, 0)
	}
	counts := make([]int, len(parts))
	m := min(n, len(parts))
	if m == 0 {
		return counts
	}
	for i := range m {
		counts[i] = n / m
	}
	return counts
}

// uniform reports whether every non-zero count is the same (one XREADGROUP reads them).
func uniform(counts []int) bool {
	c := 0
	for _, x := range counts {
		switch {
		case x == 0:
		case c == 0:
			c = x
		case x != c:
			return false
		}
	}
	return true
}

// pollEvery bounds how long a partition goes unread while a worker with fewer free slots
// than partitions serves the others' backlogs: a partition not read for pollEvery is
// read before them (shareReads' due), so a backlog in one partition delays a job of
// another by about pollEvery rather than by the backlog.
const pollEvery = contendedBlock

// shareReads divides n slots between the partitions of a read, whose last reads filled
// what they asked (hot[i]: more may wait) or did not; the partitions are in the order
// that gets any remainder first, starting at start. It returns what to ask of each,
// summing to n (0 means not read this time). When no partition is hot, each gets an
// equal share. When some are, each other one gets 1 (enough to see that work arrived,
// and to be asked for a share next time) and the hot ones share the rest. With fewer
// slots than partitions each read one gets 1: first the due ones (due[i]: not read for
// a while; due may be nil), then the hot ones, then the others, each in order, so a
// backlog in some partitions does not starve the others.
func shareReads(n int, hot, due []bool, start int) []int {
	m := len(hot)
	counts := make([]int, m)
	if n <= 0 || m == 0 {
		return counts
	}
	order := make([]int, 0, m)
	for k := range m {
		order = append(order, (start+k)%m)
	}
	nhot := 0
	for _, h := range hot {
		if h {
			nhot++
		}
	}
	if n < m {
		// One each: the due ones, then the hot ones, then the others.
		rank := func(i int) int {
			switch {
			case due != nil && due[i]:
				return 0
			case hot[i]:
				return 1
			}
			return 2
		}
		for want := range 3 {
			for _, i := range order {
				if rank(i) == want && n > 0 && counts[i] == 0 {
					counts[i] = 1
					n--
				}
			}
		}
		return counts
	}
	share := func(sel func(int) bool, count, total int) {
		base, extra := total/count, total%count
		for _, i := range order {
			if !sel(i) {
				continue
			}
			counts[i] = base
			if extra > 0 {
				counts[i]++
				extra--
			}
		}
	}
	if nhot == 0 {
		share(func(int) bool { return true }, m, n)
		return counts
	}
	for i, h := range hot {
		if !h {
			counts[i] = 1
		}
	}
	share(func(i int) bool { return hot[i] }, nhot, n-(m-nhot))
	return counts
}

// await waits for new entries while every partition of the group came back short at its
// last read and one XREADGROUP cannot name them all (a Redis Cluster): it starts a
// blocking read of each partition that has none outstanding (wait), each holding one
// slot, as many as the free slots and the gate's limit (0: none) allow, and returns when
// one of them ends (with its error), when a reclaim scan falls due, or false when ctx is
// cancelled. While a partition has no blocking read for want of a slot, the ones started
// block for at most contendedBlock, and the next free slot starts one for it.
func (r *reader) await(ctx, hctx context.Context, limit int) (bool, error) {
	w := r.w
	var need []*part
	for _, p := range r.rotated(&r.nextWait) {
		if !p.waiting {
			need = append(need, p)
		}
	}
	outstanding := len(r.parts) - len(need)
	if limit > 0 && len(need) > limit {
		need = need[:limit]
	}
	taken := 0
	if len(need) > 0 && outstanding == 0 {
		// Nothing blocks for this group: wait for the slot of one.
		select {
		case w.slots <- struct{}{}:
			taken = 1
		case <-ctx.Done():
			return false, nil
		}
	}
	taken += w.takeUpTo(len(need) - taken)
	need = r.start(hctx, need, taken)
	next := w.cfg.ClaimInterval
	now := time.Now()
	for _, p := range r.parts {
		next = min(next, max(p.lastScan.Add(w.cfg.ClaimInterval).Sub(now), time.Millisecond))
	}
	t := time.NewTimer(next)
	defer t.Stop()
	for {
		var slot chan struct{}
		if len(need) > 0 {
			slot = w.slots
		}
		select {
		case u := <-r.woke:
			r.note(u)
			return true, u.err
		case slot <- struct{}{}:
			need = r.start(hctx, need, 1)
		case <-t.C:
			return true, nil
		case <-ctx.Done():
			return false, nil
		}
	}
}

// start starts blocking reads of the first n of need, holding a slot each (taken by the
// caller), and returns the rest.
func (r *reader) start(hctx context.Context, need []*part, n int) []*part {
	w := r.w
	block := w.cfg.Block
	switch {
	case w.sharedBudgetFull():
		// Every slot is taken, and other readers share them: do not block on one
		// (pauseRead says why); wait restarts after pollEvery.
		block = -1
	case n < len(need):
		block = min(block, contendedBlock)
	}
	for _, p := range need[:n] {
		p.waiting = true
		r.waiters.Go(func() { r.wait(hctx, p, block) })
	}
	return need[n:]
}

// wait is one blocking XREADGROUP of p alone (COUNT 1), holding one slot: it dispatches
// the entry it returns, or gives the slot back, and reports its end on r.woke. A wait
// that does not block (block < 0) and got nothing reports its end pollEvery after giving
// the slot back, so that the partition is read again only then.
func (r *reader) wait(hctx context.Context, p *part, block time.Duration) {
	w := r.w
	ctx := context.WithoutCancel(hctx)
	res, err := w.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: w.cfg.Group, Consumer: w.cfg.Consumer,
		Streams: []string{p.stream, ">"}, Count: 1, Block: block}).Result()
	got := false
	if err == nil {
		for _, s := range res {
			for _, m := range s.Messages {
				w.deliver(hctx, delivery{p: p, id: m.ID, fields: m.Values, deliveries: 1})
				got = true
			}
		}
	}
	if !got {
		w.release(1)
		if block < 0 {
			pauseRead(hctx)
		}
	}
	switch {
	case errors.Is(err, redis.Nil):
		err = nil
	case err != nil:
		w.m.redisError("read")
		if isNoGroup(err) {
			w.recreateGroups(p)
		}
		err = fmt.Errorf("read new messages of %s: %w", p.keys.Name(), err)
	}
	r.woke <- wakeup{p: p, got: got, err: err}
}

// note records the end of p's blocking read: an entry means more may follow.
func (r *reader) note(u wakeup) {
	u.p.waiting = false
	if u.got {
		u.p.full = true
	}
}

// noteWakeups notes the blocking reads that ended, and returns the first one's error.
func (r *reader) noteWakeups() error {
	var first error
	for {
		select {
		case u := <-r.woke:
			r.note(u)
			first = firstErr(first, u.err)
		default:
			return first
		}
	}
}

// settleWaiters waits for the outstanding blocking reads (they dispatch what they read)
// and notes their ends, so that the next reader of these partitions starts clean.
func (r *reader) settleWaiters() {
	r.waiters.Wait()
	_ = r.noteWakeups()
}
