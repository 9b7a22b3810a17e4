package retrytest_test

import (
	"context"
	"testing"
	"time"

	"github.com/onceflow/onceflow/retry/retrytest"
)

func TestManualClockMovesOnlyWhenSleptOrAdvanced(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := retrytest.NewClock(t0)
	if err := c.Sleep(context.Background(), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	c.Advance(time.Second)
	if !c.Now().Equal(t0.Add(4*time.Second)) || c.Elapsed() != 4*time.Second || len(c.Sleeps()) != 1 {
		t.Fatalf("now %v, elapsed %v, sleeps %v", c.Now(), c.Elapsed(), c.Sleeps())
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.Sleep(ctx, time.Hour); err == nil || len(c.Sleeps()) != 1 {
		t.Fatal("a cancelled sleep was recorded")
	}
}

func TestSkipClockSkipsSleepsWithoutWaiting(t *testing.T) {
	c := retrytest.NewSkipClock()
	before := c.Now()
	start := time.Now()
	_ = c.Sleep(context.Background(), time.Hour)
	if time.Since(start) > time.Minute {
		t.Fatal("the skip clock slept for real")
	}
	if d := c.Now().Sub(before); d < time.Hour || d > time.Hour+time.Minute {
		t.Fatalf("skip clock moved %v, want about 1h", d)
	}
	if c.Elapsed() < time.Hour {
		t.Fatalf("elapsed %v", c.Elapsed())
	}
}

func TestSeededRandsAgreeAndMaxGivesTheHighestValue(t *testing.T) {
	a, b := retrytest.NewRand(1), retrytest.NewRand(1)
	for range 100 {
		if x, y := a.Int64N(1000), b.Int64N(1000); x != y || x < 0 || x >= 1000 {
			t.Fatalf("seeded rands disagree or out of range: %d %d", x, y)
		}
	}
	if (retrytest.Max{}).Int64N(10) != 9 {
		t.Fatal("Max")
	}
}
