// Command minimal is onceflow's smallest workflow: it enqueues a typed job with an
// idempotency key, runs its worker, and sends the job's one effect exactly once (here
// printed; a real sender is a webhook or SMTP). Run it against Redis and PostgreSQL:
// ONCEFLOW_REDIS_URL, ONCEFLOW_DATABASE_URL, and ONCEFLOW_PREFIX (optional) name them.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
)

// Welcome is the job: its Kind routes it to its worker.
type Welcome struct {
	Email string `json:"email"`
}

func (Welcome) Kind() string { return "welcome" }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	dsn := os.Getenv("ONCEFLOW_DATABASE_URL")
	_, err := migrations.Up(ctx, dsn, nil)
	check(err)
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	check(err)
	db, err := onceflow.NewPostgres(ctx, dsn)
	check(err)

	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Welcome](func(ctx context.Context, job *onceflow.Job[Welcome]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error { // once per job, however often it runs
			c.Emit("email.welcome", "welcome:"+job.ID, job.Args)
			return nil
		})
	}))
	send := outbox.SenderFunc(func(ctx context.Context, m outbox.Message) error {
		_, err := fmt.Printf("send %s %s %s\n", m.Topic, m.DedupeKey, m.Payload)
		return err
	})
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: os.Getenv("ONCEFLOW_PREFIX"),
		Workers: workers, Senders: map[string]outbox.Sender{"email.": send}})
	check(err)

	res, err := client.Enqueue(ctx, Welcome{Email: "ann@example.com"}, &onceflow.EnqueueOpts{Key: "welcome-ann"})
	check(err)
	fmt.Printf("enqueued %s replayed=%v\n", res.JobID, res.Replayed)
	check(client.Run(ctx)) // until Ctrl-C
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
