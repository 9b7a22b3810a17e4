//go:build onceflowtest

package cli

import (
	"context"
	"errors"
	"flag"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// This file is compiled only with the build tag onceflowtest, which the tests' binary
// has (internal/testenv.Binary) and `make build` has not: the production binary has no
// --test-handler (work_notest.go).

// testHandlerSpecs lists what --test-handler accepts.
const testHandlerSpecs = "noop | sleep:DURATION | record:DURATION | fail | permanent"

// testHandlerUsage is the --test-handler part of `onceflow work`'s usage line.
const testHandlerUsage = "[--test-handler SPEC]"

// testHandlerFlag registers --test-handler on fs and returns its value: the SPEC of the
// handler to run on one queue instead of its workers, "" for the workers.
func testHandlerFlag(fs *flag.FlagSet) *string {
	return fs.String("test-handler", "", "TEST AID, not for production: run `"+testHandlerSpecs+"` on the queue instead of its workers")
}

// newTestHandler builds the handler `onceflow work --test-handler=SPEC` runs instead of
// the queue's workers. It is a test aid, kept apart from the real handler, so that tests
// can run `work` as a real process (and kill -9 it) without a model or database:
//
//	noop             acknowledge every job at once
//	sleep:DURATION   take DURATION per job (less if cancelled by the shutdown timeout)
//	record:DURATION  like sleep, and count runs in Redis, in the hash PREFIX:{QUEUE}:test:runs:
//	                 started:JOB_ID and finished:JOB_ID incremented, deliveries:JOB_ID set
//	fail             fail every job with a transient error (redelivered until MaxDeliveries)
//	permanent        fail every job with a permanent error (dead-lettered at once)
func newTestHandler(spec string, rdb redis.UniversalClient, keys queue.Keys) (queue.Handler, error) {
	name, arg, _ := strings.Cut(spec, ":")
	var d time.Duration
	if name == "sleep" || name == "record" {
		var err error
		if d, err = time.ParseDuration(arg); err != nil || d < 0 {
			return nil, usageErrorf("invalid --test-handler=%q: want %s", spec, testHandlerSpecs)
		}
	} else if arg != "" {
		return nil, usageErrorf("invalid --test-handler=%q: want %s", spec, testHandlerSpecs)
	}
	sleep := func(ctx context.Context) error {
		select {
		case <-time.After(d):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	runs := keys.Key("test:runs")
	switch name {
	case "noop":
		return queue.HandlerFunc(func(context.Context, *queue.Job) error { return nil }), nil
	case "sleep":
		return queue.HandlerFunc(func(ctx context.Context, _ *queue.Job) error { return sleep(ctx) }), nil
	case "record":
		return queue.HandlerFunc(func(ctx context.Context, j *queue.Job) error {
			pipe := rdb.TxPipeline()
			pipe.HIncrBy(ctx, runs, "started:"+j.JobID, 1)
			pipe.HSet(ctx, runs, "deliveries:"+j.JobID, j.Deliveries)
			if _, err := pipe.Exec(ctx); err != nil {
				return err
			}
			if err := sleep(ctx); err != nil {
				return err
			}
			return rdb.HIncrBy(ctx, runs, "finished:"+j.JobID, 1).Err()
		}), nil
	case "fail":
		return queue.HandlerFunc(func(context.Context, *queue.Job) error { return errors.New("test handler: transient failure") }), nil
	case "permanent":
		return queue.HandlerFunc(func(context.Context, *queue.Job) error {
			return retry.Permanent(errors.New("test handler: permanent failure"))
		}), nil
	}
	return nil, usageErrorf("invalid --test-handler=%q: want %s", spec, testHandlerSpecs)
}
