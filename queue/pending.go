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

// EntryStatus is where a stream entry is in a consumer group; see EntryState.
type EntryStatus int

// The statuses EntryState reports.
const (
	// EntryWaiting: not yet delivered to the group (or the stream or group is missing).
	EntryWaiting EntryStatus = iota
	// EntryDelivered: delivered and not acknowledged, so pending (running, handed back to
	// wait for a reclaim, or its worker died); see EntryPending.
	EntryDelivered
	// EntryAcknowledged: delivered and acknowledged: its job finished (a job that was
	// dead-lettered is acknowledged too; its index says failed), or the entry was
	// trimmed, which only acknowledged entries are.
	EntryAcknowledged
)

// EntryState reports where the stream entry id is in group: waiting, pending or
// acknowledged (EntryPending tells pending from not). It reads the entry's pending record and the group's last delivered id
// (XPENDING and XINFO GROUPS) in one pipelined round trip. An id that is not a stream
// entry id gives an error. Safe for concurrent use.
func EntryState(ctx context.Context, rdb redis.Cmdable, keys Keys, group, id string) (EntryStatus, error) {
	if _, _, ok := splitID(id); !ok {
		return EntryWaiting, fmt.Errorf("entry state: %q is not a stream entry id", clip(id))
	}
	pipe := rdb.Pipeline()
	pending := pipe.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: group, Start: id, End: id, Count: 1})
	groups := pipe.XInfoGroups(ctx, keys.Stream())
	_, _ = pipe.Exec(ctx)
	p, err := pending.Result()
	if isNoGroup(err) {
		return EntryWaiting, nil
	}
	if err != nil {
		return EntryWaiting, fmt.Errorf("read pending entry %s: %w", id, err)
	}
	if len(p) == 1 {
		return EntryDelivered, nil
	}
	gs, err := groups.Result()
	if err != nil {
		return EntryWaiting, fmt.Errorf("read group %s: %w", group, err)
	}
	for _, g := range gs {
		if g.Name != group {
			continue
		}
		if compareIDs(id, g.LastDeliveredID) <= 0 {
			return EntryAcknowledged, nil
		}
	}
	return EntryWaiting, nil
}

// Pending returns the pending record of stream entry id in group (its consumer, idle
// time and delivery count); ok is false when it is not pending (waiting, acknowledged,
// or the stream or group is missing). One round trip; safe for concurrent use.
func Pending(ctx context.Context, rdb redis.Cmdable, keys Keys, group, id string) (e PendingEntry, ok bool, err error) {
	p, err := rdb.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: keys.Stream(), Group: group, Start: id, End: id, Count: 1}).Result()
	if isNoGroup(err) {
		return PendingEntry{}, false, nil
	}
	if err != nil {
		return PendingEntry{}, false, fmt.Errorf("read pending entry %s: %w", id, err)
	}
	if len(p) != 1 {
		return PendingEntry{}, false, nil
	}
	return PendingEntry{ID: p[0].ID, Consumer: p[0].Consumer, Idle: p[0].Idle, Deliveries: p[0].RetryCount}, true, nil
}

// ReadEntry returns the job of stream entry id; ok is false when the stream has no such
// entry (acknowledged and trimmed, or never there). A malformed entry gives an error
// wrapping ErrMalformed. One round trip; safe for concurrent use.
func ReadEntry(ctx context.Context, rdb redis.Cmdable, keys Keys, id string) (m Message, ok bool, err error) {
	msgs, err := rdb.XRangeN(ctx, keys.Stream(), id, id, 1).Result()
	if err != nil {
		return Message{}, false, fmt.Errorf("read stream entry %s: %w", id, err)
	}
	if len(msgs) == 0 {
		return Message{}, false, nil
	}
	m, err = ParseMessage(msgs[0].Values)
	return m, err == nil, err
}
