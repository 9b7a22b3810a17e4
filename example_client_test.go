package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/pgoutbox"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/retry"
)

// Resize is a job kind of the examples below: resize an image.
type Resize struct {
	URL   string `json:"url"`
	Width int    `json:"width"`
}

func (Resize) Kind() string { return "image.resize" }

// A Client needs a Redis client with the settings the guarantees rest on (NewRedis sets
// them); NewClient checks its Config and touches no server.
func ExampleNewClient() {
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	client, err := onceflow.NewClient(onceflow.Config{
		Redis:  rdb,
		Queues: map[string]onceflow.QueueConfig{"images": {Concurrency: 8}, "email": {}},
	})
	if err != nil {
		panic(err)
	}
	fmt.Println(client.Inspector().Queues())
	// Output: [email images]
}

// Queues lists the queues Run works: Config.Queues, and those of the workflows.
func ExampleInspector_Queues() {
	rdb, _ := onceflow.NewRedis("redis://127.0.0.1:6379/0")
	defer rdb.Close()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Workflows: []onceflow.Workflow{
		{Name: "images", Queues: map[string]onceflow.QueueConfig{"images": {}}},
	}})
	if err != nil {
		panic(err)
	}
	fmt.Println(client.Inspector().Queues())
	// Output: [images]
}

// Enqueue with a key is idempotent: the second call adds nothing and returns the first
// job's id, which is derived from the key.
func ExampleClient_Enqueue() {
	rdb, prefix, _, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	opts := &onceflow.EnqueueOpts{Tenant: "acme", Key: "upload-7"}
	first, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 640}, opts)
	if err != nil {
		panic(err)
	}
	again, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 640}, opts)
	if err != nil {
		panic(err)
	}
	_, reused := client.Enqueue(ctx, Resize{URL: "https://example.com/b.png", Width: 640}, opts)
	fmt.Println(first.JobID == again.JobID, first.Replayed, again.Replayed, first.Queue)
	fmt.Println(first.JobID == onceflow.JobID(onceflow.EnqueueScope("acme", "image.resize", "upload-7")))
	fmt.Println(errors.Is(reused, idempotency.ErrKeyReused))
	// Output:
	// true false true default
	// true
	// true
}

// Run works the queues until its context ends; here one job, then a clean stop.
func ExampleClient_Run() {
	rdb, prefix, _, done := exampleStores("SELECT 1")
	defer done()
	resized := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Resize](func(ctx context.Context, job *onceflow.Job[Resize]) error {
		resized <- fmt.Sprintf("%s to %dpx (delivery %d)", job.Args.URL, job.Args.Width, job.Delivery)
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()

	if _, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 640}, nil); err != nil {
		panic(err)
	}
	fmt.Println(<-resized)
	cancel()
	fmt.Println("stopped:", <-stopped)
	// Output:
	// https://example.com/a.png to 640px (delivery 1)
	// stopped: <nil>
}

// JobState reads a job by id for its tenant: queued until a worker commits it; another
// tenant's job is not found.
func ExampleClient_JobState() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	res, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 64}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		panic(err)
	}
	st, err := client.JobState(ctx, "acme", res.JobID)
	if err != nil {
		panic(err)
	}
	fmt.Println(st.Status, st.Queue)
	_, err = client.JobState(ctx, "globex", res.JobID)
	fmt.Println(errors.Is(err, onceflow.ErrJobNotFound))
	// Output:
	// queued default
	// true
}

// Route accepts a POST with an Idempotency-Key and enqueues a job of its kind;
// StateHandler answers the GET of its Location.
func ExampleRoute() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	tenant := func(r *http.Request) (string, error) {
		if r.Header.Get("Authorization") != "Bearer k1" {
			return "", idempotency.ErrUnauthenticated
		}
		return "acme", nil
	}
	post, err := onceflow.Route(client, onceflow.RouteConfig[Resize]{
		Tenant: tenant,
		Validate: func(r *Resize) error {
			if r.Width < 1 || r.Width > 4096 {
				return errors.New("width: must be 1 to 4096")
			}
			return nil
		},
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/resizes", post)
	mux.Handle("GET /v1/resizes/{job_id}", onceflow.StateHandler(client, tenant))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	call := func(method, path, key, body string) (*http.Response, string) {
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer k1")
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, strings.TrimSpace(string(b))
	}
	resp, body := call("POST", "/v1/resizes", "resize-0000000001", `{"url": "https://example.com/a.png", "width": 640}`)
	fmt.Println(resp.StatusCode, body)
	_, body = call("POST", "/v1/resizes", "resize-0000000002", `{"url": "https://example.com/a.png", "widht": 640}`)
	fmt.Println(body)
	_, body = call("POST", "/v1/resizes", "resize-0000000003", `{"url": "https://example.com/a.png", "width": 0}`)
	fmt.Println(body)
	resp, body = call("GET", resp.Header.Get("Location"), "", "")
	fmt.Println(resp.StatusCode, body)
	// Output:
	// 202 {"job_id":"14b4539f-532d-563c-a7d5-0445f42f6ce7","status":"queued"}
	// {"detail":"widht: unknown field"}
	// {"detail":"width: must be 1 to 4096"}
	// 200 {"job_id":"14b4539f-532d-563c-a7d5-0445f42f6ce7","queue":"default","status":"queued"}
}

// StateHandler serves GET .../{job_id} for the caller's tenant: an unknown id (or
// another tenant's) is a 404.
func ExampleStateHandler() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	tenant := func(*http.Request) (string, error) { return "acme", nil } // your authentication
	mux := http.NewServeMux()
	mux.Handle("GET /v1/resizes/{job_id}", onceflow.StateHandler(client, tenant))
	res, err := client.Enqueue(context.Background(), Resize{URL: "https://example.com/a.png", Width: 64}, &onceflow.EnqueueOpts{Tenant: "acme", JobID: "resize-1"})
	if err != nil {
		panic(err)
	}
	for _, id := range []string{res.JobID, "resize-2"} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest("GET", "/v1/resizes/"+id, nil))
		fmt.Println(rec.Code, strings.TrimSpace(rec.Body.String()))
	}
	// Output:
	// 200 {"job_id":"resize-1","queue":"default","status":"queued"}
	// 404 {"detail":"no such job"}
}

// A program that builds its own queue.Worker runs the client's jobs with Handler: the
// routing by kind, the decoding and the middleware are the same as Run's.
func ExampleInspector_Handler() {
	rdb, prefix, _, done := exampleStores("SELECT 1")
	defer done()
	resized := make(chan string, 1)
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Resize](func(ctx context.Context, job *onceflow.Job[Resize]) error {
		resized <- job.Args.URL
		return nil
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	w, err := queue.NewWorker(queue.WorkerConfig{
		Redis:   rdb,
		Keys:    queue.Keys{Prefix: prefix, Queue: onceflow.DefaultQueue},
		Handler: client.Inspector().Handler(onceflow.DefaultQueue),
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- w.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	if _, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 64}, nil); err != nil {
		panic(err)
	}
	fmt.Println(<-resized)
	// Output: https://example.com/a.png
}

// A process that runs the outbox relay on its own sends what Run's relay would:
// Config.Senders by topic and EnqueueTx's jobs. Here a job enqueued in a transaction
// reaches its queue through a relay built on client.Inspector().Sender().
func ExampleInspector_Sender() {
	rdb, prefix, db, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix})
	if err != nil {
		panic(err)
	}
	relay, err := outbox.NewRelay(pgoutbox.New(db), client.Inspector().Sender(), outbox.Config{PollInterval: 20 * time.Millisecond})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- relay.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	tx, err := db.Begin(ctx)
	if err != nil {
		panic(err)
	}
	res, err := client.EnqueueTx(ctx, tx, Resize{URL: "https://example.com/a.png", Width: 64}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
	for {
		if st, err := client.JobState(ctx, "acme", res.JobID); err == nil {
			fmt.Println(st.Status, st.Queue) // in its queue now
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Output: queued default
}

// Thumbnail is the images workflow's job kind; its jobs go to the images queue.
type Thumbnail struct {
	URL   string `json:"url"`
	Width int    `json:"width"`
}

func (Thumbnail) Kind() string { return "image.thumbnail" }

func (Thumbnail) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "images"} }

// images is a workflow: its queue, its worker, its table and its routes, in one value.
func images(tables *migrations.Source) onceflow.Workflow {
	return onceflow.Workflow{
		Name:   "images",
		Queues: map[string]onceflow.QueueConfig{"images": {Concurrency: 4}},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Thumbnail](func(ctx context.Context, job *onceflow.Job[Thumbnail]) error {
				return nil // resize job.Args.URL
			}))
		},
		Migrations: tables,
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			post, err := onceflow.Route(c, onceflow.RouteConfig[Thumbnail]{
				Tenant: func(*http.Request) (string, error) { return "acme", nil },
			})
			if err != nil {
				return err
			}
			mux.Handle("POST /v1/resizes", post)
			return nil
		},
	}
}

// A program lists its workflows in Config.Workflows: NewClient merges their queues,
// workers and senders; Mount mounts their routes.
func ExampleWorkflow() {
	rdb, _ := onceflow.NewRedis("redis://127.0.0.1:6379/0")
	defer rdb.Close()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Workflows: []onceflow.Workflow{images(nil)}})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	if err := client.Mount(mux); err != nil {
		panic(err)
	}
	_, pattern := mux.Handler(httptest.NewRequest("POST", "/v1/resizes", nil))
	fmt.Println(client.Inspector().Queues(), pattern)
	// Output: [images] POST /v1/resizes
}

// Mount mounts every workflow's routes; the POST enqueues on the workflow's queue.
func ExampleClient_Mount() {
	rdb, prefix, _, done := exampleStores("SELECT 1")
	defer done()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workflows: []onceflow.Workflow{images(nil)}})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	if err := client.Mount(mux); err != nil {
		panic(err)
	}
	req := httptest.NewRequest("POST", "/v1/resizes", strings.NewReader(`{"url": "https://example.com/a.png", "width": 64}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "resize-0000000001")
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, req)
	n, _ := rdb.XLen(context.Background(), queue.Keys{Prefix: prefix, Queue: "images"}.Stream()).Result()
	fmt.Println(rec.Code, "jobs on images:", n)
	// Output: 202 jobs on images: 1
}

// Workflows returns the workflows, for a host that lists or audits them.
func ExampleInspector_Workflows() {
	rdb, _ := onceflow.NewRedis("redis://127.0.0.1:6379/0")
	defer rdb.Close()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Workflows: []onceflow.Workflow{images(nil), {Name: "billing"}}})
	if err != nil {
		panic(err)
	}
	for _, wf := range client.Inspector().Workflows() {
		fmt.Println(wf.Name)
	}
	// Output:
	// images
	// billing
}

// Migrations returns the workflows' tables, to migrate beside onceflow's own.
func ExampleClient_Migrations() {
	rdb, _ := onceflow.NewRedis("redis://127.0.0.1:6379/0")
	defer rdb.Close()
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Workflows: []onceflow.Workflow{images(&replyTables)}})
	if err != nil {
		panic(err)
	}
	for _, src := range client.Migrations() {
		fmt.Println(src.Table)
	}
	// In main: migrations.Up(ctx, databaseURL, logger, client.Migrations()...)
	// Output: replies_migrations
}

// A job id derived from an idempotency key is the UUIDv5 of its scope: a program can
// compute the id of a job it enqueued, or will enqueue, with a key.
func ExampleJobID() {
	fmt.Println(onceflow.JobID(onceflow.EnqueueScope("acme", "image.resize", "upload-7")))
	// Output: c93f44ba-ae77-5219-ae48-76ddd6bc9224
}

// EnqueueScope is the scope of Enqueue's keys: the tenant, the method ENQUEUE, the kind
// and the key.
func ExampleEnqueueScope() {
	s := onceflow.EnqueueScope("acme", "image.resize", "upload-7")
	fmt.Println(s.Tenant, s.Method, s.Path, s.Key)
	// Output: acme ENQUEUE image.resize upload-7
}

// On another queue than DefaultQueue the scope names the queue: the same key there is
// another key, and another job.
func ExampleEnqueueScopeOn() {
	s := onceflow.EnqueueScopeOn("images", "acme", "image.resize", "upload-7")
	fmt.Println(s.Path, onceflow.EnqueueScopeOn(onceflow.DefaultQueue, "acme", "image.resize", "upload-7") == onceflow.EnqueueScope("acme", "image.resize", "upload-7"))
	// Output: image.resize@images true
}

// NewWorkers is the registry a Client takes in Config.Workers.
func ExampleNewWorkers() {
	workers := onceflow.NewWorkers()
	onceflow.AddWorker[Resize](workers, &resizer{maxWidth: 4096})
	rdb, _ := onceflow.NewRedis("redis://127.0.0.1:6379/0")
	defer rdb.Close()
	if _, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Workers: workers}); err != nil {
		panic(err)
	}
	fmt.Println(workers.Kinds())
	// Output: [image.resize]
}

// AddWorker registers the Worker of a kind; the kind is its arguments' Kind().
func ExampleAddWorker() {
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Resize](func(ctx context.Context, job *onceflow.Job[Resize]) error {
		return nil
	}))
	fmt.Println(workers.Kinds())
	// Output: [image.resize]
}

// AddWorkerSafely returns AddWorker's mistakes as errors: a second worker of a kind.
func ExampleAddWorkerSafely() {
	workers := onceflow.NewWorkers()
	noop := onceflow.WorkFunc[Resize](func(context.Context, *onceflow.Job[Resize]) error { return nil })
	fmt.Println(onceflow.AddWorkerSafely(workers, noop))
	fmt.Println(onceflow.AddWorkerSafely(workers, noop))
	// Output:
	// <nil>
	// onceflow: AddWorker: kind "image.resize" already has a worker
}

// Kinds lists the registered kinds, sorted.
func ExampleWorkers_Kinds() {
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Resize](func(context.Context, *onceflow.Job[Resize]) error { return nil }))
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(context.Context, *onceflow.Job[Refund]) error { return nil }))
	fmt.Println(workers.Kinds())
	// Output: [image.resize refund]
}

// resizer is a Worker as a type: its dependencies are fields.
type resizer struct {
	maxWidth int
}

func (r *resizer) Work(ctx context.Context, job *onceflow.Job[Resize]) error {
	if job.Args.Width > r.maxWidth {
		return onceflow.Permanent(fmt.Errorf("width %d: over %d", job.Args.Width, r.maxWidth)) // dead-lettered
	}
	return nil // resize
}

// A Worker with state of its own is a type with a Work method.
func ExampleWorker() {
	workers := onceflow.NewWorkers()
	onceflow.AddWorker[Resize](workers, &resizer{maxWidth: 4096})
	fmt.Println(workers.Kinds())
	// Output: [image.resize]
}

// A Middleware wraps every job of every kind, as net/http middleware wraps handlers:
// here it logs each job and its outcome.
func ExampleMiddleware() {
	rdb, prefix, _, done := exampleStores("SELECT 1")
	defer done()
	logged := make(chan string, 1)
	logJobs := func(next onceflow.JobFunc) onceflow.JobFunc {
		return func(ctx context.Context, info *onceflow.JobInfo) error {
			err := next(ctx, info)
			logged <- fmt.Sprintf("%s on %s, delivery %d: %v", info.Kind, info.Queue, info.Delivery, err)
			return err
		}
	}
	workers := onceflow.NewWorkers()
	onceflow.AddWorker[Resize](workers, &resizer{maxWidth: 4096})
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, Prefix: prefix, Workers: workers, Middleware: []onceflow.Middleware{logJobs}})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()
	if _, err := client.Enqueue(ctx, Resize{URL: "https://example.com/a.png", Width: 9000}, nil); err != nil {
		panic(err)
	}
	fmt.Println(<-logged)
	// Output: image.resize on default, delivery 1: width 9000: over 4096
}

// Permanent marks a failure no retry can fix: the job is dead-lettered at once.
func ExamplePermanent() {
	err := onceflow.Permanent(errors.New("order not found"))
	fmt.Println(errors.Is(err, onceflow.ErrPermanent), err)
	// Output: true order not found
}

// IsPermanent recognises the marker whichever package set it.
func ExampleIsPermanent() {
	fmt.Println(onceflow.IsPermanent(retry.Permanent(errors.New("bad input"))), onceflow.IsPermanent(errors.New("timeout")))
	// Output: true false
}

// RetryAfter asks for the job to run again after a delay, as a Retry-After header does.
func ExampleRetryAfter() {
	err := onceflow.RetryAfter(30*time.Second, errors.New("the payments API is rate limited"))
	var d *retry.DelayError
	fmt.Println(errors.As(err, &d), d.Delay)
	// Output: true 30s
}

// Unavailable says a dependency is down rather than the job failed: the job is handed
// back without spending a delivery.
func ExampleUnavailable() {
	err := onceflow.Unavailable(errors.New("the payments API is down"))
	fmt.Println(errors.Is(err, onceflow.ErrUnavailable), onceflow.IsPermanent(err))
	// Output: true false
}

// OK holds only for a report that looked at something and found nothing wrong.
func ExampleAuditReport_OK() {
	empty := &onceflow.AuditReport{Workflow: "images"}
	clean := &onceflow.AuditReport{Workflow: "images", Checked: []string{"images", "job_completions"}}
	broken := &onceflow.AuditReport{Workflow: "images", Checked: []string{"images"}, Violations: []string{"job x: done without its row"}}
	fmt.Println(empty.OK(), clean.OK(), broken.OK())
	// Output: false true false
}

// Completion reads a finished job's completion record whatever its tenant: for operator
// tools (package adminui), never for an API a tenant calls, which JobState serves.
func ExampleInspector_Completion() {
	rdb, prefix, db, done := exampleStores(`CREATE TABLE refunds (job_id text PRIMARY KEY, order_id text, amount_cents int)`)
	defer done()
	workers := onceflow.NewWorkers()
	onceflow.AddWorker(workers, onceflow.WorkFunc[Refund](func(ctx context.Context, job *onceflow.Job[Refund]) error {
		return job.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO refunds (job_id, order_id, amount_cents) VALUES ($1, $2, $3)`, job.ID, job.Args.OrderID, job.Args.AmountCents)
			c.Result(map[string]int{"refunded_cents": job.Args.AmountCents})
			return nil
		})
	}))
	client, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: workers})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()
	res, err := client.Enqueue(ctx, Refund{OrderID: "order-7", AmountCents: 300}, &onceflow.EnqueueOpts{Tenant: "acme"})
	if err != nil {
		panic(err)
	}
	waitDone(client, "acme", res.JobID)
	st, err := client.Inspector().Completion(ctx, res.JobID)
	if err != nil {
		panic(err)
	}
	fmt.Println(st.Status, st.Tenant, st.Kind, string(st.Result))
	_, err = client.Inspector().Completion(ctx, "no-such-job")
	fmt.Println(errors.Is(err, onceflow.ErrJobNotFound))
	// Output:
	// done acme refund {"refunded_cents": 300}
	// true
}
