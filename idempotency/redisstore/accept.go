package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
)

// Enqueue is what Accept adds to a Redis stream when it accepts a new request, for a
// stream that no package owns: the caller passes the stream entry's fields and,
// optionally, an index hash to write alongside. For a queue whose package exports its
// enqueue (package queue), use AcceptWrite with that package's Lua instead, so its
// rules for the keys it owns (a job index, dead letters) hold on this path too.
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

// maxArgs bounds the fields of one Accept and the args of one Write: Lua's unpack
// places them on a stack of at most 8000 slots.
const maxArgs = 4000

// ErrNoHashTag is returned by Accept when Enqueue.Stream has no hash tag, or
// Enqueue.IndexKey's differs from it, and by AcceptWrite when the Write's keys do not
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

// Write is what an accept writes, in its one script, when it accepts a new key: the
// enqueue of a job. Its Lua comes from the package that owns the keys it writes (for a
// queue of package queue: queue.EnqueueLua with queue.Keys.EnqueueKeys and
// queue.EnqueueArgs), so the accept runs that package's logic, never a copy of it.
// redisstore adds only its own part around it: the record check before and the stored
// response after.
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

// acceptHead and acceptTail wrap a Write's Lua into the accept script.
//
//	KEYS[1]  the record key; KEYS[2:] the Write's keys, in one slot
//	ARGV[1]  the fingerprint
//	ARGV[2]  the final record to store (encodeDone)
//	ARGV[3]  the result TTL in milliseconds
//	ARGV[4:] the Write's args
//	returns {0} fingerprint differs (reused), {1} an in-progress marker of the generic
//	path holds the key, {2, record} replay (nothing written), {3} accepted
//
// Invariant: a key is accepted at most once per result TTL: the Write and the stored
// response happen together or not at all (the Write raises its errors before its first
// write, the response is stored after it, and the shebang makes Redis refuse the whole
// script, not half of it, when out of memory), so there is no crash window between
// enqueueing and storing the response and no in-progress state.
const (
	acceptHead = `#!lua
local v = redis.call('GET', KEYS[1])
if v then
  local fp = ARGV[1] .. '\n'
  if string.sub(v, 2, #fp + 1) ~= fp then return {0} end
  if string.sub(v, 1, 1) ~= 'D' then return {1} end
  return {2, v}
end
local function write(keys, argv)
`
	acceptTail = `
end
local wkeys, wargv = {}, {}
for i = 2, #KEYS do wkeys[#wkeys + 1] = KEYS[i] end
for i = 4, #ARGV do wargv[#wargv + 1] = ARGV[i] end
write(wkeys, wargv)
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {3}
`
)

// acceptScripts caches the accept script of each Write Lua (*redis.Script by Lua text).
var acceptScripts sync.Map

// acceptScript returns the accept script fused with the Write body lua.
func acceptScript(lua string) *redis.Script {
	if sc, ok := acceptScripts.Load(lua); ok {
		return sc.(*redis.Script)
	}
	sc, _ := acceptScripts.LoadOrStore(lua, redis.NewScript(acceptHead+lua+acceptTail))
	return sc.(*redis.Script)
}

// runAccept runs the accept script sc. With Config.WaitReplicas it sends, in one
// pipeline on the one connection to the primary of keys[0]: the script, a SET of a
// marker key in the same slot, and WAIT. The marker makes the connection's last write
// come after everything the primary had when the script ran, the record a replay read
// included (replication is in order), so WAIT confirms the replicas have the job
// whether this accept wrote it or replays it. A NOSCRIPT (the script did not run) is
// retried once with the script's text; a MOVED (the slot moved: the script did not
// run) once after the cluster client reloads its slot map. ASK and TRYAGAIN (the
// slot is migrating) are returned: the API answers 503 until the migration ends.
func (s *Store) runAccept(ctx context.Context, sc *redis.Script, keys []string, args []any) ([]any, error) {
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

// enqueueLua is the Write body of Accept's Enqueue: XADD to any stream and, optionally,
// HSET (and PEXPIRE) one hash in its slot.
//
//	keys[1]  the stream; keys[2] (optional) the index hash
//	argv[1]  the index TTL in milliseconds (0: no expiry)
//	argv[2]  n, the number of stream field/value arguments that follow
//	argv[3 .. 2+n] the stream fields; argv[3+n ..] the index fields
const enqueueLua = `
local t = redis.call('TYPE', keys[1]).ok
if t ~= 'stream' and t ~= 'none' then error({err = 'WRONGTYPE stream key holds a ' .. t}) end
if keys[2] then
  t = redis.call('TYPE', keys[2]).ok
  if t ~= 'hash' and t ~= 'none' then error({err = 'WRONGTYPE index key holds a ' .. t}) end
end
local n = tonumber(argv[2])
local id = redis.call('XADD', keys[1], '*', unpack(argv, 3, 2 + n))
if keys[2] then
  redis.call('HSET', keys[2], unpack(argv, 3 + n, #argv))
  if tonumber(argv[1]) > 0 then redis.call('PEXPIRE', keys[2], argv[1]) end
end
return id
`

// Accept is AcceptWrite with a plain Write: e's entry added to e.Stream and, when set,
// e's index hash written, for a stream no package owns. A queue of package queue has
// its own enqueue (its job index, its dead letters): accept its jobs with AcceptWrite
// and queue.EnqueueLua instead.
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
	return s.AcceptWrite(ctx, scope, fp, resp, Write{Lua: enqueueLua, Keys: keys, Args: args})
}

// AcceptWrite is the single-round-trip path for routes whose only work is a write to
// Redis, typically an enqueue: in one Lua script (one round trip once the script is
// cached; see LoadScripts) it looks the key up and either
//
//   - finds a record with another fingerprint: ErrKeyReused, nothing written;
//   - finds a generic-path in-progress marker (only when Config.HashTag puts generic
//     records in the same slot): ErrInProgress, nothing written;
//   - finds a stored response: returns it with replayed true, nothing written;
//   - finds nothing: runs w and stores resp for Config.ResultTTL, atomically; returns
//     resp with replayed false.
//
// Any other error (Redis unreachable, a timeout, an invalid Write, an error w raised)
// means the caller should answer 503; after a timeout the script may have run, and a
// retry then replays. AcceptWrite is safe for concurrent use: of concurrent calls for
// one scope exactly one runs w, the others replay its response.
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
	tag, ok := hashTag(w.Keys[0])
	if !ok {
		return nil, false, ErrNoHashTag
	}
	for _, k := range w.Keys[1:] {
		if t, ok := hashTag(k); !ok || t != tag {
			return nil, false, ErrNoHashTag
		}
	}
	key := s.key(tag, scope)
	done, err := encodeDone(fp, resp)
	if err != nil {
		return nil, false, err
	}
	keys := make([]string, 0, 1+len(w.Keys))
	keys = append(append(keys, key), w.Keys...)
	args := make([]any, 0, 3+len(w.Args))
	args = append(args, fp, done, s.cfg.ResultTTL.Milliseconds())
	args = append(args, w.Args...)
	res, err := s.runAccept(ctx, acceptScript(w.Lua), keys, args)
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
