package queue

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv/scriptcheck"
)

// TestScriptsRunWithTheKeysTheirHeadersName calls the wrapper of every queue script
// once, on a client whose script calls are recorded as Redis receives them, and checks
// that every .lua file of the queue ran as part of a script, each call with the number
// of keys and args its header names.
func TestScriptsRunWithTheKeysTheirHeadersName(t *testing.T) {
	t.Parallel()
	rdb, keys := setup(t)
	rec := scriptcheck.Record(rdb)
	ctx := context.Background()
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}

	// enqueue.lua (and jobindex.lua), enqueue_at.lua, then due.lua and move.lua.
	for i := 1; i <= 4; i++ {
		_, err := Enqueue(ctx, rdb, keys, message(i, nil))
		must("Enqueue", err)
	}
	_, err := EnqueueAt(ctx, rdb, keys, message(5, nil), time.Now().Add(-time.Second))
	must("EnqueueAt", err)
	moved, _, err := MoveDue(ctx, rdb, keys, 0)
	must("MoveDue", err)
	if moved != 1 {
		t.Fatalf("MoveDue moved %d, want 1", moved)
	}
	_, err = RegisterPartitions(ctx, rdb, keys, 2)
	must("RegisterPartitions", err)

	// reclaim.lua, renew.lua: five entries delivered to consumer c.
	must("CreateGroup", CreateGroup(ctx, rdb, keys, DefaultGroup))
	w, err := NewWorker(WorkerConfig{Redis: rdb, Keys: keys, Consumer: "c", Logger: quiet,
		Handler: HandlerFunc(func(context.Context, *Job) error { return nil })})
	must("NewWorker", err)
	_, err = w.reclaim(ctx, w.parts[0], 10)
	must("reclaim", err)
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "c", Streams: []string{keys.Stream(), ">"}, Count: 5}).Result()
	must("XREADGROUP", err)
	entries := res[0].Messages
	if len(entries) != 5 {
		t.Fatalf("read %d entries, want 5", len(entries))
	}
	ids := make([]string, len(entries))
	starts := make([]time.Time, len(entries))
	msgs := make([]Message, len(entries))
	for i, e := range entries {
		ids[i], starts[i] = e.ID, time.Now()
		msgs[i], err = ParseMessage(e.Values)
		must("ParseMessage", err)
	}
	_, _, err = renew(ctx, rdb, keys, DefaultGroup, "c", ids, starts)
	must("renew", err)

	// schedule.lua (and history.lua): the first entry runs again later.
	hist := historyRecord(delivery{id: ids[0], deliveries: 1}, "c", OutcomeRetry, "blip", time.Now())
	out, err := settle(ctx, rdb, keys, DefaultGroup, "c", ids[0], &msgs[0], settlement{spend: 1, delay: time.Hour, history: hist})
	must("settle", err)
	if !out.owned || out.delay != time.Hour {
		t.Fatalf("settle = %+v, want the entry scheduled in an hour", out)
	}

	// dead_letter.lua: three dead letters, then replay.lua, purge.lua, trim_dead.lua.
	var dead []string
	for i := 1; i <= 3; i++ {
		id, ok, err := deadLetter(ctx, rdb, keys, DefaultGroup, "c", ids[i], entries[i].Values, &msgs[i], "permanent: x", 0, time.Now(), "")
		must("deadLetter", err)
		if !ok {
			t.Fatalf("dead-letter %s: not pending to c", ids[i])
		}
		dead = append(dead, id)
	}
	_, err = Replay(ctx, rdb, keys, dead[0])
	must("Replay", err)
	_, err = Wake(ctx, rdb, keys, msgs[0].Tenant, msgs[0].JobID) // wake.lua: the replayed job is queued, so it is marked
	must("Wake", err)
	must("Purge", Purge(ctx, rdb, keys, dead[1], time.Hour))
	n, err := TrimDead(ctx, rdb, keys, time.Now().Add(time.Minute), time.Hour)
	must("TrimDead", err)
	if n != 1 {
		t.Fatalf("TrimDead deleted %d, want 1", n)
	}

	// read_history.lua, then sweep_successes.lua, threshold.lua and trim_batch.lua (the
	// acknowledged entries are trimmed), delete_consumers.lua.
	_, _, err = ReadHistory(ctx, rdb, keys, msgs[0].JobID)
	must("ReadHistory", err)
	must("XACK", rdb.XAck(ctx, keys.Stream(), DefaultGroup, ids[4]).Err())
	trimmed, err := Trim(ctx, rdb, keys, time.Hour)
	must("Trim", err)
	if trimmed == 0 {
		t.Fatal("Trim trimmed nothing")
	}
	_, err = DeleteIdleConsumers(ctx, rdb, keys, DefaultGroup, "keep", 0)
	must("DeleteIdleConsumers", err)

	rec.Check(t, scripts)
}

// TestHistoryScriptBoundIsHistoryMax: lua/history.lua bounds a history with a literal;
// it must be historyMax, which the Go side documents and the tests check against.
func TestHistoryScriptBoundIsHistoryMax(t *testing.T) {
	src, err := luaFiles.ReadFile("lua/history.lua")
	if err != nil {
		t.Fatal(err)
	}
	code := string(src)
	if i := strings.Index(code, "local function"); i >= 0 {
		code = code[i:]
	}
	if n := strings.Count(code, "#h > "+strconv.Itoa(historyMax)+" then"); n != 1 {
		t.Errorf("history.lua does not bound the history at historyMax (%d bytes)", historyMax)
	}
	if n := strings.Count(code, "#h - "+strconv.Itoa(historyMax)+","); n != 1 {
		t.Errorf("history.lua does not cut the history at historyMax (%d bytes)", historyMax)
	}
}
