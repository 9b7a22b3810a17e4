// Package scriptcheck checks, in a package's tests, that the package's Redis scripts
// (its internal/redisscript Set) are called through their Go wrappers with the KEYS and
// ARGV their headers name, as Redis receives them.
//
// A test records the script calls of its own client, calls every wrapper of the
// package, then checks: every .lua file of the set is part of a script that ran, and
// every call of a script of the set carried a number of keys and of args within what
// its header names. Counts are read from the commands on the wire (EVALSHA and EVAL:
// the number of keys is their third argument), not from the wrappers' code.
package scriptcheck

import (
	"context"
	"crypto/sha1" // #nosec G505 -- EVAL names a script by its SHA-1; nothing secret
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/redisscript"
)

// call is what one EVALSHA or EVAL carried.
type call struct {
	keys, args int
}

// Recorder is a go-redis hook that records every script call by the script's SHA-1.
// It is safe for concurrent use.
type Recorder struct {
	mu    sync.Mutex
	calls map[string][]call
}

var _ redis.Hook = (*Recorder)(nil)

// Record adds a Recorder to c (a *redis.Client or *redis.ClusterClient of the test's
// own) and returns it.
func Record(c interface{ AddHook(redis.Hook) }) *Recorder {
	r := &Recorder{calls: map[string][]call{}}
	c.AddHook(r)
	return r
}

// DialHook implements redis.Hook.
func (r *Recorder) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (r *Recorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		r.record(cmd)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (r *Recorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			r.record(cmd)
		}
		return next(ctx, cmds)
	}
}

func (r *Recorder) record(cmd redis.Cmder) {
	args := cmd.Args()
	if len(args) < 3 {
		return
	}
	var sha string
	switch cmd.Name() {
	case "evalsha", "evalsha_ro":
		sha = fmt.Sprint(args[1])
	case "eval", "eval_ro":
		sum := sha1.Sum([]byte(fmt.Sprint(args[1]))) // #nosec G401 -- as Redis names scripts
		sha = hex.EncodeToString(sum[:])
	default:
		return
	}
	n, err := strconv.Atoi(fmt.Sprint(args[2]))
	if err != nil {
		return
	}
	r.mu.Lock()
	r.calls[sha] = append(r.calls[sha], call{keys: n, args: len(args) - 3 - n})
	r.mu.Unlock()
}

// Check fails t unless every .lua file of set is part of a script of set that ran since
// Record, and every recorded call of a script of set carried the keys and args its
// header names.
func (r *Recorder) Check(t testing.TB, set *redisscript.Set) {
	t.Helper()
	files, err := set.Files()
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("the set has no .lua file")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	ran := map[string]bool{}
	for _, sc := range set.Scripts() {
		calls := r.calls[sc.Hash()]
		for _, c := range calls {
			if err := sc.Check(make([]string, c.keys), make([]any, c.args)); err != nil {
				t.Errorf("a call sent to Redis: %v", err)
			}
		}
		if len(calls) > 0 {
			for _, f := range sc.Files() {
				ran[f] = true
			}
		}
	}
	for _, f := range files {
		if !ran[f] {
			t.Errorf("%s: no script made of it ran: call its wrapper in this test", f)
		}
	}
}
