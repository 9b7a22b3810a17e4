package onceflow_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/queue"
)

// Visit is a job kind whose Worker counts what its deliveries did.
type Visit struct {
	Page string `json:"page"`
}

func (Visit) Kind() string { return "visit" }

// Committed tells a Worker whether its Commit wrote the job (done) or found it written
// by an earlier delivery (a duplicate), both of which return nil: for its metrics.
func ExampleJob_Committed() {
	rdb, prefix, db, done := exampleStores(`CREATE TABLE visits (job_id text PRIMARY KEY, page text)`)
	defer done()

	outcomes := make(chan string, 2)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Visit](func(ctx context.Context, job *onceflow.Job[Visit]) error {
		err := job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO visits (job_id, page) VALUES ($1, $2)`, job.ID, job.Args.Page)
			return nil
		})
		if err == nil && job.Committed() {
			outcomes <- "done"
		} else if err == nil {
			outcomes <- "duplicate"
		}
		return err
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	must(err)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	// The same job id twice: two deliveries of one job.
	for range 2 {
		_, err := client.Enqueue(ctx, Visit{Page: "/pricing"}, &onceflow.EnqueueOpts{JobID: "visit-1"})
		must(err)
		fmt.Println(<-outcomes)
	}
	// Output:
	// done
	// duplicate
}

// A workflow reads its own tables through the client's pool (Inspector.DB) and inspects its
// queue with the queue package (Inspector.Redis, Inspector.QueueKeys).
func ExampleInspector_QueueKeys() {
	rdb, prefix, db, done := exampleStores(``)
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	must(err)
	keys := client.Inspector().QueueKeys("default")
	fmt.Println(keys.Stream() == prefix+":{default}:stream", client.Inspector().DB() == db, client.Inspector().Redis() == rdb)
	// Output: true true true
}

// A queue of three partitions has three sets of keys, each under a hash tag of its own
// (a Redis Cluster spreads them over its nodes); inspecting the whole queue reads them
// all, here with queue.ReadStatsOf.
func ExampleInspector_QueuePartitions() {
	rdb, prefix, _, done := exampleStores(``)
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix,
		QueueDefaults: onceflow.QueueConfig{Partitions: 3}})
	must(err)
	ctx := context.Background()
	for i := range 6 {
		_, err := client.Enqueue(ctx, Visit{Page: fmt.Sprintf("/p%d", i)}, nil)
		must(err)
	}
	parts, err := client.Inspector().QueuePartitions(ctx, "default")
	must(err)
	for _, keys := range parts {
		fmt.Println(strings.TrimPrefix(keys.Stream(), prefix))
	}
	st, err := queue.ReadStatsOf(ctx, rdb, parts, queue.DefaultGroup)
	must(err)
	fmt.Println("jobs:", st.Length)
	// Output:
	// :{default}:stream
	// :{default:1}:stream
	// :{default:2}:stream
	// jobs: 6
}

// PingRedis is a readiness check of Redis: of the one Redis here, of every primary of a
// Redis Cluster client (naming those that do not answer).
func ExamplePingRedis() {
	rdb, _, _, done := exampleStores(``)
	defer done()
	fmt.Println(onceflow.PingRedis(context.Background(), rdb))
	// Output: <nil>
}

// LoadScripts, at start, saves the first accept of a route or a keyed Enqueue its second
// round trip.
func ExampleClient_LoadScripts() {
	rdb, prefix, _, done := exampleStores(``)
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix})
	must(err)
	fmt.Println(client.LoadScripts(context.Background()))
	// Output: <nil>
}

// Breakers are the circuit breakers the queues wait on: a readiness check reports the
// open ones (Err says since when and why), and breaker.Set combines them into the gate
// of a worker of one's own.
func ExampleInspector_Breakers() {
	rdb, prefix, db, done := exampleStores(``)
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	must(err)
	for _, b := range client.Inspector().Breakers() {
		fmt.Println(b.Name(), b.Err())
	}
	// Output:
	// redis <nil>
	// postgres <nil>
}
