package adminui

import (
	"context"

	"github.com/onceflow/onceflow/queue"
)

// partitions returns the keys of every partition of every queue of the client, each
// shown under its Keys.Name ("summaries", "summaries:1", ...): the pages treat each
// partition as a queue of its own, and a queue of one partition is itself. Without
// Redis's record of earlier partitions, the configured ones (logged).
func (u *UI) partitions(ctx context.Context) []queue.Keys {
	var out []queue.Keys
	for _, name := range u.client.Inspector().Queues() {
		parts, err := u.client.Inspector().QueuePartitions(ctx, name)
		if err != nil {
			u.log.WarnContext(ctx, "adminui: read the queue's partitions", "queue", name, "err", err)
		}
		out = append(out, parts...)
	}
	return out
}

// queueNames returns the names of partitions(ctx).
func (u *UI) queueNames(ctx context.Context) []string {
	parts := u.partitions(ctx)
	names := make([]string, len(parts))
	for i, k := range parts {
		names[i] = k.Name()
	}
	return names
}
