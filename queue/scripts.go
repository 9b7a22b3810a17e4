package queue

import (
	"embed"

	"github.com/onceflow/onceflow/internal/redisscript"
)

// The queue's Redis scripts are the .lua files in lua/, one a script or a library of
// Lua functions, each with a header naming its KEYS, ARGV, reply and the invariant it
// keeps (internal/redisscript). Each is run by one typed Go function next to the code
// that uses it; the enqueue functions are also exported as Steps (EnqueueStep,
// EnqueueAtStep) for a script of another package to run in its own atomic step.
//
//go:embed lua/*.lua
var luaFiles embed.FS

// scripts is the queue's script set.
var scripts = redisscript.NewSet(luaFiles)

// The libraries the queue's scripts share.
var (
	// jobIndexLib: check_job_id and retire, the job index rules of every enqueue.
	jobIndexLib = scripts.MustLib("lua/jobindex.lua")
	// historyLib: history(key, rec), the append to a job's history.
	historyLib = scripts.MustLib("lua/history.lua")
	// enqueueLib: enqueue(keys, argv), the queue's enqueue.
	enqueueLib = scripts.MustLib("lua/enqueue.lua", jobIndexLib)
	// enqueueAtLib: enqueue_at(keys, argv), the enqueue of a job that runs at a time.
	enqueueAtLib = scripts.MustLib("lua/enqueue_at.lua", jobIndexLib)
)

// The queue's enqueue functions, run alone by Enqueue and EnqueueAt and in another
// package's script through EnqueueStep and EnqueueAtStep.
var (
	enqueueFunc   = enqueueLib.Func("enqueue")
	enqueueAtFunc = enqueueAtLib.Func("enqueue_at")
)

// StepFunctions returns the functions of the queue's steps (those of EnqueueStep and
// EnqueueAtStep), for loading the scripts that compose them into Redis ahead of their
// first use (redisstore.Store.Preload), in this order: EnqueueStep's, EnqueueAtStep's.
func StepFunctions() []*redisscript.Function {
	return []*redisscript.Function{enqueueFunc, enqueueAtFunc}
}
