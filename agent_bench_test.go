package onceflow_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/onceflowtest"
)

// countingTracer counts the statements a pool sends.
type countingTracer struct{ n atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// tracedPool returns a pool of 32 connections on a schema of the benchmark's own, its
// URL, and the counter of the statements it sends.
func tracedPool(b *testing.B) (*pgxpool.Pool, string, *countingTracer) {
	b.Helper()
	_, url := testenv.Postgres(b)
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		b.Fatal(err)
	}
	tracer := &countingTracer{}
	pcfg.ConnConfig.Tracer = tracer
	pcfg.MaxConns = 32
	db, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		b.Fatal(err)
	}
	return db, url, tracer
}

// pgCounters reads the database's committed transactions and the server's WAL flushes,
// on a connection of its own. Backends publish their statistics at most once a second
// while busy and when they exit: read them after closing the pool that did the work.
func pgCounters(b *testing.B, url string) (commits, flushes int64) {
	b.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.Background())
	err = conn.QueryRow(context.Background(), `SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
		(SELECT wal_sync FROM pg_stat_wal)`).Scan(&commits, &flushes)
	if err != nil {
		b.Fatal(err)
	}
	return commits, flushes
}

// BenchmarkAgentLoop runs b.N agent jobs of 4 model turns and 3 tool calls (a lookup,
// a check, a refund), each job committing its reply: "recorded" through RunAgent (every
// tool result recorded, the history canonical), "by-hand" the same loop without
// recording (Job.Complete per turn, the tools called directly). It reports jobs/s, and
// per job the PostgreSQL statements the client sent, the transactions committed and the
// WAL flushes (pg_stat_wal.wal_sync: durable commits) of the whole server, which should
// run nothing else. `make bench` runs it; docs/BENCHMARKS.md has the figures.
func BenchmarkAgentLoop(b *testing.B) {
	for _, mode := range []string{"by-hand", "recorded"} {
		b.Run(mode, func(b *testing.B) { benchAgentLoop(b, mode == "recorded") })
	}
}

func benchAgentLoop(b *testing.B, recorded bool) {
	b.StopTimer()
	rdb, prefix := testenv.Redis(b)
	db, url, tracer := tracedPool(b)
	defer db.Close()
	if _, err := db.Exec(context.Background(), `CREATE TABLE agent_replies (job_id text PRIMARY KEY, body text NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	model := &onceflowtest.ScriptedModel{RandomIDs: true, Turns: []onceflowtest.Turn{
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("lookup_order", lookupArgs{Order: "A-1"})}},
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("check_policy", lookupArgs{Order: "A-1"})}},
		{ToolCalls: []llm.ToolCall{onceflowtest.Call("issue_refund", refundToolArgs{Order: "A-1", Amount: 1250})}},
		{Text: "Refunded."},
	}}
	answer := func(name string) func(ctx context.Context, key string, args lookupArgs) (string, error) {
		return func(ctx context.Context, key string, args lookupArgs) (string, error) {
			return fmt.Sprintf(`{"tool":%q,"order":%q,"at":%d}`, name, args.Order, time.Now().UnixNano()), nil
		}
	}
	tools := []onceflow.AgentTool{
		onceflow.MustTool("lookup_order", "", answer("lookup_order")),
		onceflow.MustTool("check_policy", "", answer("check_policy")),
		onceflow.MustTool("issue_refund", "", func(ctx context.Context, key string, args refundToolArgs) (string, error) {
			return `{"status":"succeeded"}`, nil
		}),
	}
	byName := map[string]func(ctx context.Context, call llm.ToolCall) string{}
	for _, name := range []string{"lookup_order", "check_policy", "issue_refund"} {
		byName[name] = func(ctx context.Context, call llm.ToolCall) string {
			return fmt.Sprintf(`{"tool":%q,"args":%s,"at":%d}`, name, call.Arguments, time.Now().UnixNano())
		}
	}
	var done atomic.Int64
	all := make(chan struct{})
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[orderArgs](func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		req := agentRequest(j.Args.Order)
		var reply string
		if recorded {
			res, err := onceflow.RunAgent(ctx, j, onceflow.AgentConfig{Request: req, Tools: tools})
			if err != nil {
				return err
			}
			reply = res.Answer
		} else {
			for _, t := range tools { // the same tools offered to the model
				req.Tools = append(req.Tools, llm.Tool{Name: t.Name, Description: t.Description, Parameters: t.Parameters})
			}
			msgs := req.Messages
			for turn := 1; ; turn++ {
				r := *req
				r.Messages = msgs
				st, err := j.Complete(ctx, fmt.Sprintf("agent.turn-%d", turn), &r)
				if err != nil {
					return err
				}
				msgs = append(msgs, llm.Message{Role: llm.RoleAssistant, Content: st.Response.Content, ToolCalls: st.Response.ToolCalls})
				if len(st.Response.ToolCalls) == 0 {
					reply = st.Response.Content
					break
				}
				for _, c := range st.Response.ToolCalls {
					msgs = append(msgs, llm.Message{Role: llm.RoleTool, ToolCallID: c.ID, Content: byName[c.Name](ctx, c)})
				}
			}
		}
		err := j.Commit(ctx, func(c *onceflow.Commit) error {
			c.Exec(`INSERT INTO agent_replies (job_id, body) VALUES ($1, $2)`, j.ID, reply)
			return nil
		})
		if err == nil && done.Add(1) == int64(b.N) {
			close(all)
		}
		return err
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: ws, Model: model, NoLimits: true,
		Logger: slog.New(slog.DiscardHandler), QueueDefaults: onceflow.QueueConfig{Concurrency: 16}})
	if err != nil {
		b.Fatal(err)
	}
	for i := range b.N {
		if _, err := c.Enqueue(context.Background(), orderArgs{Order: fmt.Sprint(i)}, nil); err != nil {
			b.Fatal(err)
		}
	}
	statements := tracer.n.Load()
	db.Reset() // the setup's connections exit, publishing their statistics
	time.Sleep(200 * time.Millisecond)
	commits, flushes := pgCounters(b, url)
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	b.StartTimer()
	start := time.Now()
	go func() { stopped <- c.Run(ctx) }()
	select {
	case <-all:
	case <-time.After(10 * time.Minute):
		b.Fatalf("%d of %d jobs done in 10 minutes", done.Load(), b.N)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	<-stopped
	statements = tracer.n.Load() - statements
	db.Close() // the work's connections exit, publishing their statistics
	time.Sleep(200 * time.Millisecond)
	c2, f2 := pgCounters(b, url)
	n := float64(b.N)
	b.ReportMetric(n/elapsed.Seconds(), "jobs/s")
	b.ReportMetric(float64(statements)/n, "statements/job")
	b.ReportMetric(float64(c2-commits-1)/n, "commits/job") // less pgCounters' own
	b.ReportMetric(float64(f2-flushes)/n, "walflushes/job")
}

// BenchmarkParkedJobs parks b.N jobs on WaitSignal, reports the Redis memory they take
// (used_memory's growth per job) and checks that no worker holds any of them, then
// signals each and reports the time from the call of Client.Signal to the job running
// again (p50, p99), with 16 signals in flight.
func BenchmarkParkedJobs(b *testing.B) {
	b.StopTimer()
	rdb, prefix := testenv.Redis(b)
	db, _ := testenv.Postgres(b)
	ctx := context.Background()
	var parked, resumed atomic.Int64
	woken := make([]atomic.Int64, b.N) // the Unix ns each job ran again
	ids := make([]string, b.N)
	index := map[string]int{}
	ws := onceflow.NewWorkers()
	onceflow.AddWorker(ws, onceflow.WorkFunc[orderArgs](func(ctx context.Context, j *onceflow.Job[orderArgs]) error {
		_, err := onceflow.WaitSignal(ctx, j, "go", time.Hour)
		if err != nil {
			parked.Add(1)
			return err
		}
		woken[index[j.ID]].Store(time.Now().UnixNano())
		resumed.Add(1)
		return nil
	}))
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Workers: ws, Logger: slog.New(slog.DiscardHandler),
		QueueDefaults: onceflow.QueueConfig{Concurrency: 32}})
	if err != nil {
		b.Fatal(err)
	}
	memory := func() int64 {
		info, err := rdb.InfoMap(ctx, "memory").Result()
		if err != nil {
			b.Fatal(err)
		}
		var n int64
		fmt.Sscan(info["Memory"]["used_memory"], &n)
		return n
	}
	before := memory()
	for i := range b.N {
		res, err := c.Enqueue(ctx, orderArgs{Order: fmt.Sprint(i)}, nil)
		if err != nil {
			b.Fatal(err)
		}
		ids[i], index[res.JobID] = res.JobID, i
	}
	rctx, cancel := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(rctx) }()
	defer func() { cancel(); <-stopped }()
	testenv.WaitFor(b, 30*time.Minute, "every job to park", func() bool {
		n, err := rdb.ZCard(ctx, c.Inspector().QueueKeys(onceflow.DefaultQueue).Scheduled()).Result()
		return err == nil && n == int64(b.N)
	})
	p, err := rdb.XPending(ctx, c.Inspector().QueueKeys(onceflow.DefaultQueue).Stream(), "workers").Result()
	if err == nil && p.Count != 0 {
		b.Fatalf("%d entries held by workers while every job waits", p.Count)
	}
	b.ReportMetric(float64(memory()-before)/float64(b.N), "redis-bytes/parked-job")
	sent := make([]int64, b.N)
	b.StartTimer()
	sem := make(chan struct{}, 16)
	for i, id := range ids {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			sent[i] = time.Now().UnixNano()
			if err := c.Signal(ctx, "", id, "go", nil); err != nil {
				b.Error(err)
			}
		}()
	}
	testenv.WaitFor(b, 30*time.Minute, "every job to run again", func() bool { return resumed.Load() == int64(b.N) })
	b.StopTimer()
	lat := make([]time.Duration, b.N)
	for i := range lat {
		lat[i] = max(time.Duration(woken[i].Load()-sent[i]), 0)
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "signal-to-run-p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "signal-to-run-p99-ms")
}
