// Package redisstore is the Redis implementation of idempotency.Store, plus AcceptStep
// (and Accept): the single-round-trip path that checks a key, runs a write (typically
// the enqueue of a job: a Step of the package that owns the written keys, such as
// queue.EnqueueStep) and stores the response in one Lua script.
//
// Keys (every key starts with the configured prefix and a colon, and never contains the
// client's key, only the SHA-256 of its scope):
//
//	<prefix>:idem:<sha256(scope)>          generic records (Config.HashTag empty)
//	<prefix>:{<tag>}:idem:<sha256(scope)>  generic records with Config.HashTag, and the
//	                                       records of AcceptStep and Accept, <tag> being
//	                                       the hash tag of the keys they write
//
// Its scripts are the .lua files in lua/ (complete.lua, release.lua, and accept.lua, a
// template whose write the Step supplies), each with a header naming its KEYS, ARGV,
// reply and invariant. Every script names all the keys it touches in KEYS and those keys
// share one hash slot, so the store works on Redis Cluster (pass a *redis.ClusterClient).
// Redis 7.0 or later is required (SET NX GET, script shebangs).
package redisstore

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/redisscript"
)

// Defaults of Config.
const (
	DefaultPrefix         = "onceflow"
	DefaultResultTTL      = idempotency.DefaultResultTTL
	DefaultCleanupTimeout = 2 * time.Second
)

// Config configures a Store.
type Config struct {
	// Prefix starts every key, followed by a colon. It must not contain braces.
	// Default: "onceflow".
	Prefix string
	// HashTag, when set, puts generic records in the hash slot of {HashTag}
	// (<prefix>:{HashTag}:idem:<hash>): set it to the tag of a route's stream to make
	// generic and Accept records of that route the same keys. Default: empty.
	HashTag string
	// ResultTTL is how long AcceptStep and Accept keep a response. (Claim and Complete
	// take their TTLs per call from the middleware.) Default: 24h.
	ResultTTL time.Duration
	// CleanupTimeout bounds the background release of a marker whose SET timed out (it
	// may have been applied). Default: 2s.
	CleanupTimeout time.Duration
	// Logger receives cleanup failures. Default: slog.Default().
	Logger *slog.Logger
	// WaitReplicas, when above 0, makes AcceptStep (and Accept) confirm that many
	// replicas have its write before it answers: WAIT WaitReplicas WaitTimeout, sent in
	// the same round trip as the script on the same connection to the key's primary.
	// Redis replicates asynchronously; without it, a primary that answered and died
	// before its replicas had the write loses the accepted job at the failover
	// (docs/operations.md, "Redis Cluster"). Fewer replicas in time gives an error
	// matching ErrNotReplicated (the API answers 503; the write stays, and a retry
	// with the same key replays it once the replicas confirm). Default: 0 (no WAIT).
	WaitReplicas int
	// WaitTimeout bounds the WAIT. Default: 1s.
	WaitTimeout time.Duration
}

// ErrNotReplicated is matched by the error of an accept whose write fewer than
// Config.WaitReplicas replicas confirmed within Config.WaitTimeout: it is on the
// primary, and may be lost if the primary fails before a replica has it.
var ErrNotReplicated = errors.New("redisstore: the write was not confirmed by enough replicas")

// DefaultWaitTimeout is Config.WaitTimeout's default.
const DefaultWaitTimeout = time.Second

// waitable reports whether WAIT can follow a write on rdb's connection to the key's
// primary (see runAccept).
func waitable(rdb redis.UniversalClient) bool {
	switch rdb.(type) {
	case *redis.Client, *redis.ClusterClient:
		return true
	}
	return false
}

// Store keeps idempotency records in Redis. It is safe for concurrent use.
type Store struct {
	rdb redis.UniversalClient
	cfg Config
	log *slog.Logger
}

var _ idempotency.Store = (*Store)(nil)

// New returns a Store on rdb, which should come from internal/connect (no client-side
// retries: a retried script could run twice). It returns an error for an invalid Config.
func New(rdb redis.UniversalClient, cfg Config) (*Store, error) {
	cfg.Prefix = cmp.Or(cfg.Prefix, DefaultPrefix)
	cfg.ResultTTL = cmp.Or(cfg.ResultTTL, DefaultResultTTL)
	cfg.CleanupTimeout = cmp.Or(cfg.CleanupTimeout, DefaultCleanupTimeout)
	cfg.WaitTimeout = cmp.Or(cfg.WaitTimeout, DefaultWaitTimeout)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	switch {
	case rdb == nil:
		return nil, errors.New("redisstore: nil redis client")
	case strings.ContainsAny(cfg.Prefix, "{}"):
		return nil, fmt.Errorf("redisstore: prefix %q must not contain braces", cfg.Prefix)
	case strings.ContainsAny(cfg.HashTag, "{}"):
		return nil, fmt.Errorf("redisstore: hash tag %q must not contain braces", cfg.HashTag)
	case cfg.ResultTTL < time.Millisecond || cfg.CleanupTimeout < 0:
		return nil, errors.New("redisstore: ResultTTL must be at least 1ms")
	case cfg.WaitReplicas < 0 || cfg.WaitTimeout < time.Millisecond:
		return nil, errors.New("redisstore: WaitReplicas must not be negative, WaitTimeout at least 1ms")
	case cfg.WaitReplicas > 0 && !waitable(rdb):
		return nil, fmt.Errorf("redisstore: WaitReplicas needs a *redis.Client or *redis.ClusterClient, not %T", rdb)
	}
	return &Store{rdb: rdb, cfg: cfg, log: cfg.Logger}, nil
}

// Key returns the Redis key of scope's generic record.
func (s *Store) Key(scope idempotency.Scope) string {
	return s.key(s.cfg.HashTag, scope)
}

func (s *Store) key(tag string, scope idempotency.Scope) string {
	if tag == "" {
		return s.cfg.Prefix + ":idem:" + scope.Hash()
	}
	return s.cfg.Prefix + ":{" + tag + "}:idem:" + scope.Hash()
}

// Preload loads the store's scripts into Redis's script cache, so that the first call of
// each costs one round trip (EVALSHA) rather than two (EVALSHA, NOSCRIPT, EVAL): its own,
// Accept's, and AcceptStep's for each function in fns (the functions of the Steps the
// caller will accept, such as queue.StepFunctions()). It is optional: scripts load
// themselves on first use.
func (s *Store) Preload(ctx context.Context, fns ...*Function) error {
	scripts := []*redisscript.Script{completeScript, releaseScript, acceptScript.With(enqueueStreamFunc)}
	for _, fn := range fns {
		scripts = append(scripts, acceptScript.With(fn))
	}
	for _, sc := range scripts {
		if err := sc.Load(ctx, s.rdb); err != nil {
			return fmt.Errorf("load idempotency scripts: %w", err)
		}
	}
	return nil
}

// Claim implements idempotency.Store in one round trip: SET key marker NX PX lockTTL GET
// both takes a free key and, when the key is taken, returns its record, atomically (so
// there is no window in which the key vanishes between a failed SET and a GET).
//
// When the SET fails without an answer from Redis (a timeout or cancellation) it may
// still have been applied; Claim then deletes the marker in the background, guarded by
// its token, within CleanupTimeout, so that a failed claim does not block the key for
// the lock TTL. If Redis stays unreachable that cleanup fails too and the marker, if it
// exists, expires after lockTTL.
func (s *Store) Claim(ctx context.Context, scope idempotency.Scope, fp string, lockTTL time.Duration) (*idempotency.Lock, *idempotency.Response, error) {
	if err := checkFingerprint(fp); err != nil {
		return nil, nil, err
	}
	if lockTTL < time.Millisecond {
		return nil, nil, errors.New("redisstore: lock TTL must be at least 1ms")
	}
	lock := &idempotency.Lock{Scope: scope, Fingerprint: fp, Token: idempotency.NewToken()}
	key := s.Key(scope)
	marker := encodeMarker(fp, lock.Token)
	old, err := s.rdb.SetArgs(ctx, key, marker, redis.SetArgs{Mode: "NX", TTL: lockTTL, Get: true}).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return lock, nil, nil
	case err != nil:
		if maybeApplied(err) {
			go s.cleanup(context.WithoutCancel(ctx), key, marker)
		}
		return nil, nil, fmt.Errorf("claim idempotency key: %w", err)
	}
	rec, err := decodeRecord(old)
	if err != nil {
		return nil, nil, fmt.Errorf("claim idempotency key %s: %w", key, err)
	}
	if rec.fingerprint != fp {
		return nil, nil, idempotency.ErrKeyReused
	}
	if rec.state != stateDone {
		return nil, nil, idempotency.ErrInProgress
	}
	return nil, rec.resp, nil
}

// maybeApplied reports whether a command that failed with err may still have run on the
// server: no reply was read (timeout, cancellation, broken connection). A Redis error
// reply, a refused connection or an exhausted pool mean it did not.
func maybeApplied(err error) bool {
	var rerr redis.Error
	if errors.As(err, &rerr) || errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrClosed) {
		return false
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return false
	}
	return true
}

func (s *Store) cleanup(ctx context.Context, key, marker string) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.CleanupTimeout)
	defer cancel()
	if _, err := s.release(ctx, key, marker); err != nil {
		s.log.WarnContext(ctx, "idempotency claim cleanup failed; the marker, if set, expires with the lock TTL", "error", err)
	}
}

//go:embed lua/*.lua
var luaFiles embed.FS

// scripts is the store's script set.
var scripts = redisscript.NewSet(luaFiles)

// completeScript replaces the caller's in-progress marker with the final record, only
// while the key holds that marker (lua/complete.lua).
var completeScript = scripts.MustScript("lua/complete.lua")

// releaseScript deletes the caller's in-progress marker, only while the key holds it
// (lua/release.lua).
var releaseScript = scripts.MustScript("lua/release.lua")

// release runs releaseScript: it deletes key if it holds marker, and reports whether it
// did.
func (s *Store) release(ctx context.Context, key, marker string) (bool, error) {
	n, err := releaseScript.Run(ctx, s.rdb, []string{key}, marker).Int()
	return n == 1, err
}

// Complete implements idempotency.Store: one round trip (EVALSHA of completeScript).
func (s *Store) Complete(ctx context.Context, lock *idempotency.Lock, resp *idempotency.Response, resultTTL time.Duration) error {
	if resultTTL < time.Millisecond {
		return errors.New("redisstore: result TTL must be at least 1ms")
	}
	done, err := encodeDone(lock.Fingerprint, resp)
	if err != nil {
		return err
	}
	ok, err := completeScript.Run(ctx, s.rdb, []string{s.Key(lock.Scope)},
		encodeMarker(lock.Fingerprint, lock.Token), done, resultTTL.Milliseconds()).Int()
	if err != nil {
		return fmt.Errorf("complete idempotency key: %w", err)
	}
	if ok == 0 {
		return idempotency.ErrLockLost
	}
	return nil
}

// Release implements idempotency.Store: one round trip (EVALSHA of releaseScript).
func (s *Store) Release(ctx context.Context, lock *idempotency.Lock) error {
	ok, err := s.release(ctx, s.Key(lock.Scope), encodeMarker(lock.Fingerprint, lock.Token))
	if err != nil {
		return fmt.Errorf("release idempotency key: %w", err)
	}
	if !ok {
		return idempotency.ErrLockLost
	}
	return nil
}
