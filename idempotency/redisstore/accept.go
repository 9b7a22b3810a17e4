package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/redisscript"
)

// Enqueue is what Accept adds to a Redis stream when it accepts a new request, for a
// stream that no package owns: the caller passes the stream entry's fields and,
// optionally, an index hash to write alongside. For a queue whose package exports its
// enqueue as a Step (package queue: queue.EnqueueStep), use AcceptStep with that Step
// instead, so its rules for the keys it owns (a job index, dead letters) hold on this
// path too.
//
// Stream must carry a Redis Cluster hash tag ("onceflow:{summaries}:stream"); Accept
// keeps the record in the same slot (<prefix>:{summaries}:idem:<hash>), and IndexKey, when
// set, must carry the same tag. That is how the caller says which slot to use.
type Enqueue struct {
	// Stream is the stream key the entry is added to (XADD ... * fields). Required.
	Stream string
	// Fields are the entry's field/value pairs. Required, an even number.
	Fields []any
	// IndexKey, when set, is a hash that receives IndexFields (HSET) with IndexTTL.
	IndexKey string
	// IndexFields are the index's field/value pairs. Required with IndexKey, even.
	IndexFields []any
	// IndexTTL is the index's lifetime (PEXPIRE); zero means it does not expire.
	IndexTTL time.Duration
}

// maxArgs bounds the fields of one Accept and the args of one Step: Lua's unpack places
// them on a stack of at most 8000 slots.
const maxArgs = 4000

// ErrNoHashTag is returned by Accept when Enqueue.Stream has no hash tag, or
// Enqueue.IndexKey's differs from it, and by AcceptStep when the Step's keys do not
// share one hash tag.
var ErrNoHashTag = errors.New("redisstore: Enqueue keys need one shared hash tag ({...})")

// hashTag returns the part of key Redis Cluster hashes when it is not the whole key: the
// text between the first '{' and the first '}' after it, if that is not empty.
func hashTag(key string) (string, bool) {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return "", false
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return "", false
	}
	return key[i+1 : i+1+j], true
}

// AcceptKey returns the record key Accept uses for scope with stream: the generic key
// placed in the stream's hash slot.
func (s *Store) AcceptKey(stream string, scope idempotency.Scope) (string, error) {
	tag, ok := hashTag(stream)
	if !ok {
		return "", ErrNoHashTag
	}
	return s.key(tag, scope), nil
}

// Step is a write of another package that an accept runs inside its one script: a Lua
// function defined by the package that owns the keys it writes, with its keys and args
// (for a queue of package queue: queue.EnqueueStep or queue.EnqueueAtStep). The accept
// runs that package's function, never a copy of it, and adds only its own part around
// it: the record check before and the stored response after (lua/accept.lua). A Step's
// function raises every error before its first write: once it returns, the response is
// stored, and after an error nothing is.
type Step = redisscript.Step

// Function is the Lua function of a Step, an opaque handle its owner exports for
// Preload (queue.StepFunctions).
type Function = redisscript.Function

// acceptScript is the accept (lua/accept.lua), a template whose write is the function of
// the Step it runs: acceptScript.With(fn) is the script for Steps of fn.
var acceptScript = scripts.MustTemplate("lua/accept.lua", "write")

// runAccept runs the accept script sc. With Config.WaitReplicas it sends, in one
// pipeline on the one connection to the primary of keys[0]: the script, a SET of a
// marker key in the same slot, and WAIT. The marker makes the connection's last write
// come after everything the primary had when the script ran, the record a replay read
// included (replication is in order), so WAIT confirms the replicas have the job
// whether this accept wrote it or replays it. A NOSCRIPT (the script did not run) is
// retried once with the script's text; a MOVED (the slot moved: the script did not
// run) once after the cluster client reloads its slot map. ASK and TRYAGAIN (the
// slot is migrating) are returned: the API answers 503 until the migration ends.
func (s *Store) runAccept(ctx context.Context, sc *redisscript.Script, keys []string, args []any) ([]any, error) {
	if err := sc.Check(keys, args); err != nil {
		return nil, err
	}
	if s.cfg.WaitReplicas <= 0 {
		return sc.Run(ctx, s.rdb, keys, args...).Slice()
	}
	// One marker key per slot, rewritten by every accept that waits.
	tag, _ := hashTag(keys[0])
	marker := s.cfg.Prefix + ":{" + tag + "}:wait"
	moved := false
	for try := 0; ; try++ {
		node, err := primaryFor(ctx, s.rdb, keys[0])
		if err != nil {
			return nil, err
		}
		var res, wait *redis.Cmd
		_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
			if try == 0 {
				res = sc.EvalSha(ctx, p, keys, args...)
			} else {
				res = sc.Eval(ctx, p, keys, args...)
			}
			p.Set(ctx, marker, "1", time.Minute)
			wait = p.Do(ctx, "wait", s.cfg.WaitReplicas, s.cfg.WaitTimeout.Milliseconds())
			return nil
		})
		if err := res.Err(); err != nil {
			switch {
			case try == 0 && redis.HasErrorPrefix(err, "NOSCRIPT"):
				continue
			case !moved && redis.HasErrorPrefix(err, "MOVED"):
				if cc, ok := s.rdb.(*redis.ClusterClient); ok {
					moved = true
					cc.ReloadState(ctx)
					continue
				}
			}
			return nil, err
		}
		n, err := wait.Int64()
		if err != nil {
			return nil, fmt.Errorf("%w: WAIT: %w", ErrNotReplicated, err)
		}
		if n < int64(s.cfg.WaitReplicas) {
			return nil, fmt.Errorf("%w: %d of %d replicas within %s", ErrNotReplicated, n, s.cfg.WaitReplicas, s.cfg.WaitTimeout)
		}
		return res.Slice()
	}
}

// primaryFor returns the client of the one server that holds key: the client itself,
// or on a Redis Cluster the primary of key's slot.
func primaryFor(ctx context.Context, rdb redis.UniversalClient, key string) (*redis.Client, error) {
	switch c := rdb.(type) {
	case *redis.Client:
		return c, nil
	case *redis.ClusterClient:
		n, err := c.MasterForKey(ctx, key)
		if err != nil {
			return nil, fmt.Errorf("find the primary of %s: %w", key, err)
		}
		return n, nil
	}
	return nil, fmt.Errorf("redisstore: WaitReplicas needs a *redis.Client or *redis.ClusterClient, not %T", rdb)
}

// enqueueStreamFunc is the write of Accept's Enqueue (lua/enqueue_stream.lua): XADD to
// any stream and, optionally, HSET (and PEXPIRE) one hash in its slot.
var enqueueStreamFunc = scripts.MustLib("lua/enqueue_stream.lua").Func("enqueue_stream")

// Accept is AcceptStep with a write of redisstore's own: e's entry added to e.Stream
// and, when set, e's index hash written, for a stream no package owns. A queue of
// package queue has its own enqueue (its job index, its dead letters): accept its jobs
// with AcceptStep and queue.EnqueueStep instead.
func (s *Store) Accept(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, e Enqueue) (*idempotency.Response, bool, error) {
	if _, ok := hashTag(e.Stream); !ok {
		return nil, false, ErrNoHashTag
	}
	keys := []string{e.Stream}
	switch {
	case len(e.Fields) == 0 || len(e.Fields)%2 != 0:
		return nil, false, errors.New("redisstore: Enqueue.Fields needs field/value pairs")
	case len(e.Fields)+len(e.IndexFields) > maxArgs:
		return nil, false, fmt.Errorf("redisstore: more than %d Enqueue fields", maxArgs)
	case e.IndexTTL < 0:
		return nil, false, errors.New("redisstore: negative Enqueue.IndexTTL")
	case e.IndexKey != "":
		if len(e.IndexFields) == 0 || len(e.IndexFields)%2 != 0 {
			return nil, false, errors.New("redisstore: Enqueue.IndexFields needs field/value pairs")
		}
		keys = append(keys, e.IndexKey)
	case len(e.IndexFields) > 0:
		return nil, false, errors.New("redisstore: Enqueue.IndexFields without IndexKey")
	}
	args := make([]any, 0, 2+len(e.Fields)+len(e.IndexFields))
	args = append(args, e.IndexTTL.Milliseconds(), len(e.Fields))
	args = append(args, e.Fields...)
	args = append(args, e.IndexFields...)
	step, err := enqueueStreamFunc.Step(keys, args...)
	if err != nil {
		return nil, false, err
	}
	return s.AcceptStep(ctx, scope, fp, resp, step)
}

// AcceptStep is the single-round-trip path for routes whose only work is a write to
// Redis, typically an enqueue: in one Lua script (one round trip once the script is
// cached; see Preload) it looks the key up and either
//
//   - finds a record with another fingerprint: ErrKeyReused, nothing written;
//   - finds a generic-path in-progress marker (only when Config.HashTag puts generic
//     records in the same slot): ErrInProgress, nothing written;
//   - finds a stored response: returns it with replayed true, nothing written;
//   - finds nothing: runs step and stores resp for Config.ResultTTL, atomically; returns
//     resp with replayed false.
//
// The step's keys must share one hash tag ({...}): the record is placed in that slot
// (AcceptKey of its first key), else ErrNoHashTag. Any other error (Redis unreachable,
// a timeout, an invalid Step, an error the step raised) means the caller should answer
// 503; after a timeout the script may have run, and a retry then replays. AcceptStep is
// safe for concurrent use: of concurrent calls for one scope exactly one runs the step,
// the others replay its response.
func (s *Store) AcceptStep(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, step Step) (*idempotency.Response, bool, error) {
	if err := checkFingerprint(fp); err != nil {
		return nil, false, err
	}
	fn, wkeys, wargs := step.Function(), step.Keys(), step.Args()
	switch {
	case fn == nil:
		return nil, false, errors.New("redisstore: the Step has no function")
	case len(wkeys) == 0:
		return nil, false, errors.New("redisstore: the Step has no keys")
	case len(wargs) > maxArgs:
		return nil, false, fmt.Errorf("redisstore: more than %d Step args", maxArgs)
	}
	tag, ok := hashTag(wkeys[0])
	if !ok {
		return nil, false, ErrNoHashTag
	}
	for _, k := range wkeys[1:] {
		if t, ok := hashTag(k); !ok || t != tag {
			return nil, false, ErrNoHashTag
		}
	}
	key := s.key(tag, scope)
	done, err := encodeDone(fp, resp)
	if err != nil {
		return nil, false, err
	}
	keys := make([]string, 0, 1+len(wkeys))
	keys = append(append(keys, key), wkeys...)
	args := make([]any, 0, 3+len(wargs))
	args = append(args, fp, done, s.cfg.ResultTTL.Milliseconds())
	args = append(args, wargs...)
	res, err := s.runAccept(ctx, acceptScript.With(fn), keys, args)
	if err != nil {
		return nil, false, fmt.Errorf("accept idempotency key: %w", err)
	}
	code, _ := res[0].(int64)
	switch code {
	case 0:
		return nil, false, idempotency.ErrKeyReused
	case 1:
		return nil, false, idempotency.ErrInProgress
	case 2:
		v, _ := res[1].(string)
		rec, err := decodeRecord(v)
		if err != nil || rec.resp == nil {
			return nil, false, fmt.Errorf("accept idempotency key %s: %w", key, errCorrupt)
		}
		return rec.resp, true, nil
	case 3:
		return resp, false, nil
	}
	return nil, false, fmt.Errorf("accept idempotency key: unexpected reply %v", res)
}
