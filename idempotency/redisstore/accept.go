package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
)

// Enqueue is what Accept adds to a Redis stream when it accepts a new request. It is
// generic over the queue: the caller passes the stream entry's fields (a queue's message
// encoding) and, optionally, an index hash to write alongside (for example which tenant
// owns a job id).
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

// maxArgs bounds the fields of one Accept: Lua's unpack places them on a stack of at
// most 8000 slots.
const maxArgs = 4000

// ErrNoHashTag is returned by Accept when Enqueue.Stream has no hash tag, or
// Enqueue.IndexKey's differs from it.
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

// acceptScript is the single-round-trip accept path.
//
//	KEYS[1] the record key, KEYS[2] the stream, KEYS[3] (optional) the index hash; one slot
//	ARGV[1] the fingerprint
//	ARGV[2] the final record to store (encodeDone)
//	ARGV[3] the result TTL in milliseconds
//	ARGV[4] the index TTL in milliseconds (0: no expiry)
//	ARGV[5] n, the number of stream field/value arguments that follow
//	ARGV[6 .. 5+n] the stream fields; ARGV[6+n ..] the index fields
//	returns {0} fingerprint differs (reused), {1} an in-progress marker of the generic
//	path holds the key, {2, record} replay (nothing written), {3, entry id} accepted
//
// Invariant: a key is accepted at most once per result TTL: the XADD, the index and the
// stored response happen together or not at all (the types are checked before the first
// write, and the shebang makes Redis refuse the whole script, not half of it, when out
// of memory), so there is no crash window between enqueueing and storing the response
// and no in-progress state.
var acceptScript = redis.NewScript(`#!lua
local v = redis.call('GET', KEYS[1])
if v then
  local fp = ARGV[1] .. '\n'
  if string.sub(v, 2, #fp + 1) ~= fp then return {0} end
  if string.sub(v, 1, 1) ~= 'D' then return {1} end
  return {2, v}
end
local t = redis.call('TYPE', KEYS[2]).ok
if t ~= 'stream' and t ~= 'none' then return redis.error_reply('WRONGTYPE stream key holds a ' .. t) end
if KEYS[3] then
  t = redis.call('TYPE', KEYS[3]).ok
  if t ~= 'hash' and t ~= 'none' then return redis.error_reply('WRONGTYPE index key holds a ' .. t) end
end
local n = tonumber(ARGV[5])
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 6, 5 + n))
if KEYS[3] then
  redis.call('HSET', KEYS[3], unpack(ARGV, 6 + n, #ARGV))
  if tonumber(ARGV[4]) > 0 then redis.call('PEXPIRE', KEYS[3], ARGV[4]) end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {3, id}
`)

// Accept is the single-round-trip path for routes whose only work is an enqueue: in one
// Lua script (one round trip once the script is cached; see LoadScripts) it looks the key
// up and either
//
//   - finds a record with another fingerprint: ErrKeyReused, nothing written;
//   - finds a generic-path in-progress marker (only when Config.HashTag puts generic
//     records in the same slot): ErrInProgress, nothing written;
//   - finds a stored response: returns it with replayed true, nothing written;
//   - finds nothing: adds e's entry to e.Stream, writes the index, and stores resp for
//     Config.ResultTTL, atomically; returns resp with replayed false.
//
// Any other error (Redis unreachable, a timeout, an invalid Enqueue) means the caller
// should answer 503; after a timeout the script may have run, and a retry then replays.
// Accept is safe for concurrent use: of concurrent Accepts of one scope exactly one
// enqueues, the others replay its response.
func (s *Store) Accept(ctx context.Context, scope idempotency.Scope, fp string, resp *idempotency.Response, e Enqueue) (*idempotency.Response, bool, error) {
	if err := checkFingerprint(fp); err != nil {
		return nil, false, err
	}
	streamTag, ok := hashTag(e.Stream)
	if !ok {
		return nil, false, ErrNoHashTag
	}
	key := s.key(streamTag, scope)
	keys := []string{key, e.Stream}
	switch {
	case len(e.Fields) == 0 || len(e.Fields)%2 != 0:
		return nil, false, errors.New("redisstore: Enqueue.Fields needs field/value pairs")
	case len(e.Fields)+len(e.IndexFields) > maxArgs:
		return nil, false, fmt.Errorf("redisstore: more than %d Enqueue fields", maxArgs)
	case e.IndexTTL < 0:
		return nil, false, errors.New("redisstore: negative Enqueue.IndexTTL")
	case e.IndexKey != "":
		if tag, ok := hashTag(e.IndexKey); !ok || tag != streamTag {
			return nil, false, ErrNoHashTag
		}
		if len(e.IndexFields) == 0 || len(e.IndexFields)%2 != 0 {
			return nil, false, errors.New("redisstore: Enqueue.IndexFields needs field/value pairs")
		}
		keys = append(keys, e.IndexKey)
	case len(e.IndexFields) > 0:
		return nil, false, errors.New("redisstore: Enqueue.IndexFields without IndexKey")
	}
	done, err := encodeDone(fp, resp)
	if err != nil {
		return nil, false, err
	}
	args := make([]any, 0, 5+len(e.Fields)+len(e.IndexFields))
	args = append(args, fp, done, s.cfg.ResultTTL.Milliseconds(), e.IndexTTL.Milliseconds(), len(e.Fields))
	args = append(args, e.Fields...)
	args = append(args, e.IndexFields...)
	res, err := acceptScript.Run(ctx, s.rdb, keys, args...).Slice()
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
