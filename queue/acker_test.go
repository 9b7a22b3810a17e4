package queue

import (
	"context"
	"log/slog"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

// One flush of entries from several partitions is one round trip (one XACK per
// partition, pipelined with the success records of those that have them), and
// acknowledges each entry in its own partition's group.
func TestAckerAcknowledgesSeveralPartitionsInOneRoundTrip(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	keys := Keys{Prefix: prefix, Queue: "acks"}
	const parts = 3
	var batch []ack
	ps := make([]*part, parts)
	for i, k := range keys.Partitions(parts) {
		ps[i] = newPart(k, slog.New(slog.DiscardHandler))
		enqueue(t, rdb, k, message(2*i+1, nil), message(2*i+2, nil))
		if err := CreateGroup(ctx, rdb, k, DefaultGroup); err != nil {
			t.Fatal(err)
		}
		res, err := rdb.XReadGroup(ctx, readArgs(k, "c", 10)).Result()
		if err != nil || len(res[0].Messages) != 2 {
			t.Fatalf("partition %d: read %v %v", i, res, err)
		}
		for j, m := range res[0].Messages {
			e := ack{p: ps[i], id: m.ID}
			if j == 0 {
				e.history = `{"outcome":"succeeded"}`
			}
			batch = append(batch, e)
		}
	}
	trips := &roundtrip.Counter{}
	rdb.AddHook(trips)
	a := newAcker(rdb, DefaultGroup, DefaultAckBatch, DefaultAckLinger, slog.New(slog.DiscardHandler), newWorkerMetrics(nil, keys.Queue))
	a.flush(batch)
	if n := trips.Redis(); n != 1 {
		t.Errorf("acknowledging %d entries of %d partitions took %d round trips, want 1", len(batch), parts, n)
	}
	for i, k := range keys.Partitions(parts) {
		if got := pendingIDs(t, rdb, k, DefaultGroup); len(got) != 0 {
			t.Errorf("partition %d: still pending %v", i, got)
		}
		recs, err := rdb.HGetAll(ctx, k.Successes()).Result()
		if err != nil || len(recs) != 1 || recs[batch[2*i].id] != batch[2*i].history {
			t.Errorf("partition %d: success records %v %v, want its first entry's", i, recs, err)
		}
	}
}
