package queue

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// EntryPending reports whether the stream entry id is pending in group: delivered to a
// consumer and not yet acknowledged or dead-lettered (its job is running, or its worker
// died and it waits to be reclaimed). A stream or group that does not exist gives false.
// One round trip; safe for concurrent use.
func EntryPending(ctx context.Context, rdb redis.Cmdable, keys Keys, group, id string) (bool, error) {
	p, err := rdb.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: group, Start: id, End: id, Count: 1}).Result()
	if isNoGroup(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read pending entry %s: %w", id, err)
	}
	return len(p) == 1, nil
}
