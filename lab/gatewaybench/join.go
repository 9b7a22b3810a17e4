package gatewaybench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/onceflow/onceflow/internal/testenv/cluster"
)

// trialTimeout bounds one join trial.
const trialTimeout = 2 * time.Minute

// errBytesDiffer is a joiner's answer that is not the first request's, byte for byte.
var errBytesDiffer = errors.New("bytes differ from the first request's")

// JoinerResult is what the joiners sent to one place (the first request's gateway
// process, or another one) measured over the trials.
type JoinerResult struct {
	Where string
	// TTFB is the time from sending the joiner to its first body byte.
	TTFB Dist
	// CatchUp is the time from sending the joiner until it had every byte the first
	// request had when the joiner was sent.
	CatchUp Dist
	// Lag is, for every byte after those (pooled over the trials), how much later the
	// joiner got it than the first request did.
	Lag Dist
	// Joined counts answers marked Onceflow-Joined: true.
	Joined int
	// Mismatches counts answers whose bytes differ from the first request's.
	Mismatches   int
	Failures     int
	FirstFailure string
}

// JoinResult is the join measurement.
type JoinResult struct {
	Trials       int
	DripInterval time.Duration
	JoinDelay    time.Duration
	// Stream is the first request's time to the end of its stream; StreamBytes and
	// BytesAtJoin are the medians of its length and of what it had received when the
	// joiners were sent.
	Stream                   Dist
	StreamBytes, BytesAtJoin int
	// Same is the joiners sent to the first request's gateway process, Other those sent
	// to the second process.
	Same, Other  JoinerResult
	Failures     int // trials whose first request failed
	FirstFailure string
	Load         [2]float64
}

// reader is one streaming request of a trial, read on its own goroutine.
type reader struct {
	mu     sync.Mutex
	tl     timeline
	body   []byte
	header http.Header
	status int
	err    error
	sent   time.Duration // when the request was sent, after the trial's origin
	first  chan struct{} // closed at the first body byte (or at the end)
	done   chan struct{}
}

// read sends req and reads its answer into r; origin is the trial's.
func (r *reader) read(s *stack, req *http.Request, origin time.Time) {
	r.first, r.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(r.done)
		firstOnce := sync.OnceFunc(func() { close(r.first) })
		defer firstOnce()
		r.sent = time.Since(origin)
		resp, err := s.client.Do(req)
		if err != nil {
			r.err = err
			return
		}
		defer resp.Body.Close()
		r.mu.Lock()
		r.status, r.header = resp.StatusCode, resp.Header
		r.mu.Unlock()
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				r.mu.Lock()
				r.tl.add(time.Since(origin), n)
				r.body = append(r.body, buf[:n]...)
				r.mu.Unlock()
				firstOnce()
			}
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				r.mu.Lock()
				r.err = err
				r.mu.Unlock()
				return
			}
		}
	}()
}

// join measures joiners of live streams: Config.JoinTrials trials, each a streaming
// request to gateway A and, Config.JoinDelay after its first byte, the same request
// (same key) to gateway A and to gateway B at once.
func (b *bench) join(ctx context.Context, s *stack) (*JoinResult, error) {
	c := b.cfg
	if err := s.startJoin(ctx); err != nil {
		return nil, err
	}
	j := &JoinResult{Trials: c.JoinTrials, DripInterval: c.DripInterval, JoinDelay: c.JoinDelay, Load: [2]float64{cluster.LoadAvg()},
		Same: JoinerResult{Where: "same process"}, Other: JoinerResult{Where: "another process"}}
	var streams, sameTTFB, sameCatch, sameLag, otherTTFB, otherCatch, otherLag []time.Duration
	var streamBytes, atJoin []float64
	for i := range c.JoinTrials {
		first, same, other, n0, err := b.trial(ctx, s)
		if err != nil {
			return nil, err
		}
		if err := trialFailure(first, n0); err != nil {
			j.Failures++
			if j.FirstFailure == "" {
				j.FirstFailure = err.Error()
			}
			b.logf("join trial %d: %v", i+1, err)
			continue
		}
		streams = append(streams, first.tl.at[len(first.tl.at)-1]-first.sent)
		streamBytes, atJoin = append(streamBytes, float64(len(first.body))), append(atJoin, float64(n0))
		for _, x := range []struct {
			r                 *reader
			res               *JoinerResult
			ttfb, catch, lagv *[]time.Duration
		}{{same, &j.Same, &sameTTFB, &sameCatch, &sameLag}, {other, &j.Other, &otherTTFB, &otherCatch, &otherLag}} {
			if err := joinerFailure(x.r, first); err != nil {
				x.res.Failures++
				if errors.Is(err, errBytesDiffer) {
					x.res.Mismatches++
				}
				if x.res.FirstFailure == "" {
					x.res.FirstFailure = err.Error()
				}
				continue
			}
			if x.r.header.Get("Onceflow-Joined") == "true" {
				x.res.Joined++
			}
			*x.ttfb = append(*x.ttfb, x.r.tl.at[0]-x.r.sent)
			caught, _ := x.r.tl.reached(max(n0, 1))
			*x.catch = append(*x.catch, caught-x.r.sent)
			*x.lagv = append(*x.lagv, lags(&first.tl, &x.r.tl, n0)...)
		}
		b.logf("join trial %d: stream %d bytes in %v, %d at join; same process: first byte %v, caught up %v; other: first byte %v, caught up %v",
			i+1, len(first.body), (first.tl.at[len(first.tl.at)-1] - first.sent).Round(time.Millisecond), n0,
			last(sameTTFB), last(sameCatch), last(otherTTFB), last(otherCatch))
	}
	j.Stream = distOf(streams)
	j.StreamBytes, j.BytesAtJoin = int(median(streamBytes)), int(median(atJoin))
	j.Same.TTFB, j.Same.CatchUp, j.Same.Lag = distOf(sameTTFB), distOf(sameCatch), distOf(sameLag)
	j.Other.TTFB, j.Other.CatchUp, j.Other.Lag = distOf(otherTTFB), distOf(otherCatch), distOf(otherLag)
	j.Load[1] = cluster.LoadAvg()
	return j, nil
}

func last(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return ds[len(ds)-1].Round(10 * time.Microsecond)
}

// trial performs one join trial and returns its three readers (all done) and the
// bytes the first request had when the joiners were sent.
func (b *bench) trial(ctx context.Context, s *stack) (first, same, other *reader, n0 int, err error) {
	ctx, cancel := context.WithTimeout(ctx, trialTimeout)
	defer cancel()
	key := freshKey()
	origin := time.Now()
	first, same, other = &reader{}, &reader{}, &reader{}
	req, err := request(ctx, s.joinAURL, true, key)
	if err != nil {
		return nil, nil, nil, 0, err
	}
	first.read(s, req, origin)
	select {
	case <-first.first:
	case <-ctx.Done():
		return nil, nil, nil, 0, fmt.Errorf("no first byte in %v", trialTimeout)
	}
	select {
	case <-time.After(b.cfg.JoinDelay):
	case <-ctx.Done():
		return nil, nil, nil, 0, ctx.Err()
	}
	reqA, errA := request(ctx, s.joinAURL, true, key)
	reqB, errB := request(ctx, s.joinBURL, true, key)
	if err := errors.Join(errA, errB); err != nil {
		return nil, nil, nil, 0, err
	}
	first.mu.Lock()
	n0 = first.tl.bytes()
	first.mu.Unlock()
	same.read(s, reqA, origin)
	other.read(s, reqB, origin)
	for _, r := range []*reader{first, same, other} {
		select {
		case <-r.done:
		case <-ctx.Done():
			return nil, nil, nil, 0, fmt.Errorf("trial not done in %v", trialTimeout)
		}
	}
	return first, same, other, n0, ctx.Err()
}

// trialFailure says what is wrong with a trial's first request, nil if nothing.
func trialFailure(first *reader, n0 int) error {
	switch {
	case first.err != nil:
		return fmt.Errorf("first request: %w", first.err)
	case first.status != http.StatusOK:
		return fmt.Errorf("first request: status %d: %.200s", first.status, first.body)
	case !bytes.HasSuffix(first.body, streamEnd):
		return fmt.Errorf("first request: stream of %d bytes does not end with [DONE]", len(first.body))
	case n0 >= len(first.body):
		return errors.New("the stream had ended when the joiners were sent (JoinDelay too long for the stream)")
	}
	return nil
}

// joinerFailure says what is wrong with a joiner's answer, nil if nothing.
func joinerFailure(r, first *reader) error {
	switch {
	case r.err != nil:
		return r.err
	case r.status != http.StatusOK:
		return fmt.Errorf("status %d: %.200s", r.status, r.body)
	case !bytes.Equal(r.body, first.body):
		return fmt.Errorf("%w: %d bytes against %d", errBytesDiffer, len(r.body), len(first.body))
	}
	return nil
}
