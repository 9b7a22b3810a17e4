package redisstore

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/redisscript"
)

// Write is what an accept writes, in its one script, when it accepts a new key, given
// as Lua text: the body of a Lua function of (keys, argv) that does the writes.
//
// Deprecated: use AcceptStep with a Step of the package that owns the written keys
// (queue.EnqueueStep, queue.EnqueueAtStep), which carries its function, keys and args
// without exporting Lua source; Write goes in a later release.
type Write struct {
	// Lua is the body of a Lua function of (keys, argv) that does the writes. It must
	// raise every error before its first write (check the types of its keys first, and
	// raise with error()): once it returns, the response is stored, and after an error
	// nothing is. Required.
	Lua string
	// Keys are the function's keys. Required: at least one. They must share one hash tag
	// ({...}), and the accept's record is placed in that slot (AcceptKey of Keys[0]).
	Keys []string
	// Args are the function's argv; at most 4000.
	Args []any
}

// legacyFuncs holds the function of each Write Lua body (*redisscript.Function by
// text), so that each body composes one accept script.
var legacyFuncs sync.Map

// legacyFunc returns the function write(keys, argv) whose body is lua.
func legacyFunc(lua string) *redisscript.Function {
	if fn, ok := legacyFuncs.Load(lua); ok {
		return fn.(*redisscript.Function)
	}
	fn, _ := legacyFuncs.LoadOrStore(lua, redisscript.LegacyFunction("write", lua))
	return fn.(*redisscript.Function)
}

// AcceptWrite is AcceptStep with w's Lua body as the step's function, w.Keys its keys
// and w.Args its args, and the same results.
//
// Deprecated: use AcceptStep with a Step of the package that owns the written keys
// (queue.EnqueueStep for the queue's enqueue); AcceptWrite goes in a later release.
func (s *Store) AcceptWrite(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, w Write) (*idempotency.Response, bool, error) {
	if err := checkFingerprint(fp); err != nil {
		return nil, false, err
	}
	switch {
	case w.Lua == "":
		return nil, false, errors.New("redisstore: Write.Lua is empty")
	case len(w.Keys) == 0:
		return nil, false, errors.New("redisstore: Write.Keys is empty")
	case len(w.Args) > maxArgs:
		return nil, false, fmt.Errorf("redisstore: more than %d Write args", maxArgs)
	}
	step, err := legacyFunc(w.Lua).Step(w.Keys, w.Args...)
	if err != nil {
		return nil, false, err
	}
	return s.AcceptStep(ctx, scope, fp, resp, step)
}

// LoadScripts loads the store's scripts into Redis's script cache, as Preload does, and
// AcceptWrite's for each Write Lua body in writes.
//
// Deprecated: use Preload, with the functions of the Steps to be accepted
// (queue.StepFunctions()); LoadScripts goes in a later release.
func (s *Store) LoadScripts(ctx context.Context, writes ...string) error {
	fns := make([]*Function, 0, len(writes))
	for _, lua := range writes {
		fns = append(fns, legacyFunc(lua))
	}
	return s.Preload(ctx, fns...)
}
