package adminui

import (
	"context"
	"fmt"
	"html/template"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/queue"
)

// The overview's chart of the last hour is drawn from samples the UI takes itself,
// once a minute per queue (Run), of counters Redis keeps anyway: the stream's entries
// ever added (jobs accepted), the group's entries ever read and its pending entries
// (read minus pending: runs that ended) and the dead-letter stream's entries ever
// added (runs that ended in a dead letter). Nothing is written per job. Samples live
// in a hash per queue, Prefix:ui:series:<queue>, field the sample's Unix minute, value
// "added read pending dead": the counters at the interval's start (the first sample
// written in it wins, whichever process serving the UI takes it); samples older than
// seriesKeep are dropped.
const (
	seriesKeep  = 2 * time.Hour
	chartPoints = 60 // the chart's intervals: the last hour at the default interval
)

func (u *UI) seriesKey(queueName string) string { return u.prefix + ":ui:series:" + queueName }

// Run samples the queues' counters every Config.SampleInterval (the first sample of an
// interval is kept) until ctx is cancelled,
// for the overview's chart of the last hour; it returns nil then. A failed sample is
// logged and the next one tried. Run it beside the HTTP server (serve and run do).
func (u *UI) Run(ctx context.Context) error {
	// Four looks per interval: the first in each interval writes its sample, so that
	// no interval is missed when a tick comes late.
	t := time.NewTicker(u.cfg.SampleInterval / 4)
	defer t.Stop()
	for {
		if err := u.sample(ctx); err != nil && ctx.Err() == nil {
			u.log.WarnContext(ctx, "adminui: could not sample the queues for the overview's chart", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// counters are one sample of a queue.
type counters struct{ added, read, pending, dead int64 }

// sample takes one sample of every queue: one pipelined round trip to read them, one
// to write them.
func (u *UI) sample(ctx context.Context) error {
	parts := u.partitions(ctx)
	names := make([]string, len(parts))
	pipe := u.rdb.Pipeline()
	type cmds struct {
		stream *redis.XInfoStreamCmd
		groups *redis.XInfoGroupsCmd
		dead   *redis.XInfoStreamCmd
	}
	all := make([]cmds, len(names))
	for i, keys := range parts {
		names[i] = keys.Name()
		all[i] = cmds{pipe.XInfoStream(ctx, keys.Stream()), pipe.XInfoGroups(ctx, keys.Stream()), pipe.XInfoStream(ctx, keys.Dead())}
	}
	_, _ = pipe.Exec(ctx) // a queue that has no stream yet answers an error: zeros
	now := u.now()
	minute := now.Truncate(u.cfg.SampleInterval)
	w := u.rdb.Pipeline()
	for i, name := range names {
		var c counters
		if s, err := all[i].stream.Result(); err == nil {
			c.added = s.EntriesAdded
		} else if !noSuchKey(err) {
			return fmt.Errorf("sample %s: %w", name, err)
		}
		if gs, err := all[i].groups.Result(); err == nil {
			for _, g := range gs {
				if g.Name == queue.DefaultGroup {
					c.read, c.pending = g.EntriesRead, g.Pending
				}
			}
		}
		if s, err := all[i].dead.Result(); err == nil {
			c.dead = s.EntriesAdded
		}
		key := u.seriesKey(name)
		w.HSetNX(ctx, key, strconv.FormatInt(minute.Unix(), 10), fmt.Sprintf("%d %d %d %d", c.added, c.read, c.pending, c.dead))
		w.HDel(ctx, key, strconv.FormatInt(minute.Add(-seriesKeep).Unix(), 10))
		w.Expire(ctx, key, seriesKeep)
	}
	if _, err := w.Exec(ctx); err != nil {
		return fmt.Errorf("store samples: %w", err)
	}
	return nil
}

func noSuchKey(err error) bool { return err != nil && strings.Contains(err.Error(), "no such key") }

// point is one interval of a queue's chart.
type point struct {
	At              time.Time
	Accepted, Ended int64 // jobs accepted, runs ended (done or dead-lettered)
	Failed          int64 // runs that ended in a dead letter
	Missing         bool  // no sample at one of its ends
	FailurePercent  float64
	HasFailurePct   bool
}

// chart is a queue's last hour, ready to draw.
type chart struct {
	Queue                 string
	Points                []point
	Accepted, Ended, Dead int64
	FailurePercent        float64
	Max                   int64
	Interval              time.Duration
	SVG                   template.HTML
	Samples               int
}

// readChart reads the samples of queue name and turns them into per-interval counts
// for the last chartPoints intervals.
func (u *UI) readChart(ctx context.Context, name string) (chart, error) {
	raw, err := u.rdb.HGetAll(ctx, u.seriesKey(name)).Result()
	if err != nil {
		return chart{}, err
	}
	iv := u.cfg.SampleInterval
	samples := map[int64]counters{}
	for k, v := range raw {
		m, err1 := strconv.ParseInt(k, 10, 64)
		var c counters
		_, err2 := fmt.Sscanf(v, "%d %d %d %d", &c.added, &c.read, &c.pending, &c.dead)
		if err1 == nil && err2 == nil {
			samples[m] = c
		}
	}
	ch := chart{Queue: name, Interval: iv, Samples: len(samples)}
	end := u.now().Truncate(iv)
	n := chartPoints
	for i := n - 1; i >= 0; i-- {
		t1 := end.Add(-time.Duration(i) * iv)
		t0 := t1.Add(-iv)
		a, ok0 := samples[t0.Unix()]
		b, ok1 := samples[t1.Unix()]
		p := point{At: t1}
		if !ok0 || !ok1 {
			p.Missing = true
		} else {
			p.Accepted = max(b.added-a.added, 0)
			p.Ended = max((b.read-b.pending)-(a.read-a.pending), 0)
			p.Failed = max(b.dead-a.dead, 0)
			p.Ended = max(p.Ended, p.Failed) // samples of two keys are not one instant
			if p.Ended > 0 {
				p.FailurePercent, p.HasFailurePct = 100*float64(p.Failed)/float64(p.Ended), true
			}
		}
		ch.Accepted += p.Accepted
		ch.Ended += p.Ended
		ch.Dead += p.Failed
		ch.Max = max(ch.Max, p.Ended, p.Accepted)
		ch.Points = append(ch.Points, p)
	}
	if ch.Ended > 0 {
		ch.FailurePercent = 100 * float64(ch.Dead) / float64(ch.Ended)
	}
	ch.SVG = ch.svg()
	return ch, nil
}

// svg draws the chart: a bar per interval of the runs that ended (done in blue, dead
// letters in red on top), with the scale's top value; a gap where samples are missing.
func (ch *chart) svg() template.HTML {
	const w, h, left, top, bottom = 720.0, 140.0, 44.0, 8.0, 20.0
	n := float64(len(ch.Points))
	if n == 0 {
		return ""
	}
	scale := float64(max(ch.Max, 1))
	bw := (w - left) / n
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart" viewBox="0 0 %.0f %.0f" width="%.0f" height="%.0f" role="img" aria-label="Runs ended per %s over the last %s for queue %s: %d, of which %d dead-lettered">`,
		w, h, w, h, span(ch.Interval), span(ch.Interval*chartPoints), template.HTMLEscapeString(ch.Queue), ch.Ended, ch.Dead)
	fmt.Fprintf(&b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#4a4a4a"/>`, left, h-bottom, w, h-bottom)
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" font-size="11" text-anchor="end" fill="#1a1a1a">%d</text>`, left-4, top+10, ch.Max)
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" font-size="11" text-anchor="end" fill="#1a1a1a">0</text>`, left-4, h-bottom)
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" font-size="11" fill="#1a1a1a">−%s</text>`, left, h-4, span(ch.Interval*chartPoints))
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" font-size="11" text-anchor="end" fill="#1a1a1a">now</text>`, w, h-4)
	plot := h - top - bottom
	for i, p := range ch.Points {
		x := left + float64(i)*bw + 1
		if p.Missing {
			continue
		}
		done := float64(p.Ended - p.Failed)
		hd := math.Round(plot * done / scale)
		hf := math.Round(plot * float64(p.Failed) / scale)
		if hd > 0 {
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="#0b4f9c"><title>%s: %d done, %d dead-lettered, %d accepted</title></rect>`,
				x, h-bottom-hd, max(bw-2, 1), hd, p.At.UTC().Format("15:04"), p.Ended-p.Failed, p.Failed, p.Accepted)
		}
		if hf > 0 {
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="#a4161a"><title>%s: %d dead-lettered</title></rect>`,
				x, h-bottom-hd-hf, max(bw-2, 1), hf, p.At.UTC().Format("15:04"), p.Failed)
		}
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String()) // #nosec G203 -- built above from numbers and an escaped queue name
}

// span renders an interval in words: "1 min", "60 min", "15 s", "2 h".
func span(d time.Duration) string {
	switch {
	case d >= 2*time.Hour && d%time.Hour == 0:
		return strconv.FormatInt(int64(d/time.Hour), 10) + " h"
	case d >= time.Minute && d%time.Minute == 0:
		return strconv.FormatInt(int64(d/time.Minute), 10) + " min"
	}
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + " s"
}
