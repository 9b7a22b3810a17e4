package queue

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// This file is the only place that reads the text of Redis error replies.

// isBusyGroup reports whether err is Redis's reply to XGROUP CREATE for a group that
// already exists.
func isBusyGroup(err error) bool { return hasReplyPrefix(err, "BUSYGROUP") }

// isNoGroup reports whether err says the stream or its consumer group does not exist
// (someone deleted the stream, or the group was never created).
func isNoGroup(err error) bool { return hasReplyPrefix(err, "NOGROUP") }

func hasReplyPrefix(err error, prefix string) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.HasPrefix(re.Error(), prefix)
}

// CreateGroup creates the consumer group on keys.Stream(), creating the stream too
// (XGROUP CREATE ... 0 MKSTREAM). The group starts at the beginning of the stream, so
// jobs enqueued before the first worker started are delivered. It is idempotent: an
// existing group is left as it is and is not an error. Safe for concurrent use.
func CreateGroup(ctx context.Context, rdb redis.Cmdable, keys Keys, group string) error {
	err := rdb.XGroupCreateMkStream(ctx, keys.Stream(), group, "0").Err()
	if err != nil && !isBusyGroup(err) {
		return fmt.Errorf("create consumer group %s on %s: %w", group, keys.Stream(), err)
	}
	return nil
}

// isNoScript reports whether err is Redis's reply to an EVALSHA of a script it has not
// cached (the script did not run).
func isNoScript(err error) bool { return hasReplyPrefix(err, "NOSCRIPT") }
