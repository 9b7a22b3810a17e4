package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
	"github.com/onceflow/onceflow/retry"
)

// Every process of a deployment wraps its model client with a limiter on the same
// Redis: together they stay under the model's limits. A call the limiter cannot admit
// now fails at once with a *retry.WaitError saying how long to wait and why, having
// spent nothing (a queued job then waits in its queue without spending an attempt).
func ExampleLimiter_Wrap() {
	ctx := context.Background()
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	prefix := fmt.Sprintf("example%d", time.Now().UnixNano())
	defer func() {
		if keys, _ := rdb.Keys(ctx, prefix+":*").Result(); len(keys) > 0 {
			rdb.Del(ctx, keys...)
		}
	}()
	lim, err := limiter.New(rdb, limiter.Config{
		Prefix:   prefix,
		Provider: "openai",
		Models:   map[string]limiter.Limits{"gpt-4.1-mini": {RPM: 2}}, // two requests a minute, for the example
		MaxWait:  10 * time.Millisecond,
	})
	if err != nil {
		panic(err)
	}
	client := lim.Wrap(fake.New())
	ctx = limiter.WithTenant(ctx, "acme")
	for i := range 3 {
		_, err := client.Complete(ctx, &llm.Request{Model: "gpt-4.1-mini",
			Messages: []llm.Message{{Role: llm.RoleUser, Content: fmt.Sprintf("Summarise ticket %d.", i)}}})
		var wait *retry.WaitError
		switch {
		case errors.As(err, &wait):
			fmt.Printf("call %d waits about %ds: %s\n", i, int(wait.Delay.Round(10*time.Second).Seconds()), wait.Reason)
		case err != nil:
			panic(err)
		default:
			fmt.Printf("call %d answered\n", i)
		}
	}
	// Output:
	// call 0 answered
	// call 1 answered
	// call 2 waits about 30s: model openai/gpt-4.1-mini: requests per minute
}
