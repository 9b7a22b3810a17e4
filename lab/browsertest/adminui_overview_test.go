package browsertest_test

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/lab/browsertest"
)

// The overview's chart over an hour of samples, as Run writes them (one a minute of
// the queue's counters): its caption sums the runs that ended, the dead letters and
// the jobs accepted between the first and the last sample.
func TestBrowserOverviewChartOfAnHour(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t)
	now := time.Now().UTC().Truncate(time.Minute)
	e := adminuitest.New(t, adminui.Config{Now: func() time.Time { return now.Add(20 * time.Second) }})
	adminuitest.DeadLetters(t, e, 2)
	key := e.Keys.Prefix + ":ui:series:" + adminuitest.Queue
	var added, read, dead int64 = 1000, 990, 3
	var wantEnded, wantDead, wantAccepted int64
	for i := 60; i >= 0; i-- {
		if i < 60 { // the counters grow between samples
			a := int64(30 + (i*7)%25)
			f := int64(0)
			if i%9 == 4 {
				f = 2
			}
			added, read, dead = added+a, read+a, dead+f
			wantAccepted, wantEnded, wantDead = wantAccepted+a, wantEnded+a, wantDead+f
		}
		m := now.Add(-time.Duration(i) * time.Minute).Unix()
		if err := e.Redis.HSet(context.Background(), key, strconv.FormatInt(m, 10), fmt.Sprintf("%d %d 0 %d", added, read, dead)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if code := signInWith(t, ctx, e, adminuitest.AdminKey, ""); code != http.StatusOK {
		t.Fatalf("sign-in: %d", code)
	}
	caption := text(t, ctx, "figure.chart figcaption")
	want := fmt.Sprintf("%d runs ended (%d dead-lettered, a failure rate of %.1f %%), %d jobs accepted; one bar per 1 min.", wantEnded, wantDead,
		100*float64(wantDead)/float64(wantEnded), wantAccepted)
	if !strings.HasSuffix(caption, want) {
		t.Fatalf("the chart's caption is %q, want %q", caption, want)
	}
	shot(t, ctx, "overview.png")
}
