package onceflow

import (
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// ErrRedisOptions is matched by CheckRedis's errors.
var ErrRedisOptions = errors.New("onceflow: unsafe Redis client options")

// CheckRedis reports whether rdb's options are ones onceflow's guarantees hold under:
// ContextTimeoutEnabled, so that every call ends at its context's deadline (a bounded
// accept answers 503 instead of hanging), and MaxRetries -1 (no retries; go-redis's
// default, 0, means 3 on a *redis.Client), so that go-redis never
// re-sends a command by itself (the scripts are safe to retry, each documents why, but
// the retry must be onceflow's decision, within its deadline, not a hidden third and
// fourth attempt). A *redis.Client or *redis.ClusterClient built from RedisOptions
// passes. Other UniversalClient implementations are accepted as they are.
func CheckRedis(rdb redis.UniversalClient) error {
	var ctxTimeout bool
	var retries int
	switch c := rdb.(type) {
	case *redis.Client:
		o := c.Options()
		ctxTimeout, retries = o.ContextTimeoutEnabled, o.MaxRetries
	case *redis.ClusterClient:
		o := c.Options()
		ctxTimeout, retries = o.ContextTimeoutEnabled, o.MaxRetries
	default:
		return nil
	}
	switch {
	case !ctxTimeout:
		return fmt.Errorf("%w: ContextTimeoutEnabled is false (calls would outlive their context's deadline); set it, or build the client from onceflow.RedisOptions", ErrRedisOptions)
	case retries > 0: // a built client holds its normalised options: 0 or -1 for none
		return fmt.Errorf("%w: the client retries commands %d times on its own (go-redis's default MaxRetries, 0, means 3); set MaxRetries to -1, or build the client from onceflow.RedisOptions", ErrRedisOptions, retries)
	}
	return nil
}
