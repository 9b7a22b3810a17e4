package gatewaybench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/testenv/cluster"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/migrations"
)

// startTimeout bounds a process's start, up to its "listening" log line.
const startTimeout = 30 * time.Second

// stack is the benchmark's processes and database: fake-llm answering at once (fast)
// behind gateway gw, and, for the join measurement, a dripping fake-llm behind two
// gateway processes (joinA, joinB), started by startJoin.
type stack struct {
	b      *bench
	dbName string
	dbURL  string
	client *http.Client
	pool   *pgxpool.Pool  // on the benchmark's database
	ledger *ledger.Ledger // on pool: the ledger statements alone

	fast    *cluster.Proc
	fastURL string // http://host:port of fake-llm
	gw      *cluster.Proc
	gwURL   string

	proxy    *cluster.Proc // the reference proxy in front of fast (Config.ProxyBin)
	proxyURL string

	model      *cluster.Proc // fake-llm taking Config.ModelLatency per answer
	modelURL   string
	gwModel    *cluster.Proc // a gateway in front of model
	gwModelURL string

	drip         *cluster.Proc
	joinA, joinB *cluster.Proc
	joinAURL     string
	joinBURL     string
}

// newStack creates the database and starts fake-llm and the gateway in front of it; on
// error it stops what it started.
func (b *bench) newStack(ctx context.Context) (*stack, error) {
	s := &stack{b: b, client: &http.Client{Transport: &http.Transport{
		MaxIdleConns: 256, MaxIdleConnsPerHost: 128, DisableCompression: true, IdleConnTimeout: time.Minute,
	}}}
	if err := s.start(ctx); err != nil {
		s.close()
		return nil, fmt.Errorf("set up: %w", err)
	}
	return s, nil
}

func (s *stack) start(ctx context.Context) (err error) {
	c := s.b.cfg
	if err := os.MkdirAll(c.Dir, 0o750); err != nil {
		return err
	}
	if err := s.createDatabase(ctx); err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, s.dbURL, slog.New(slog.DiscardHandler)); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if s.pool, err = connect.Postgres(ctx, s.dbURL, nil); err != nil {
		return err
	}
	if s.ledger, err = ledger.New(s.pool, ledger.Config{Wait: -1, Logger: slog.New(slog.DiscardHandler)}); err != nil {
		return err
	}
	s.fast = &cluster.Proc{Name: "fake-llm", Bin: c.Bin, LogDir: c.Dir,
		Args: []string{"fake-llm", "--addr", "127.0.0.1:0", "--seed", "16", "--latency", c.UpstreamLatency.String()}}
	if s.fastURL, err = s.startProc(ctx, s.fast, "fake-llm listening"); err != nil {
		return err
	}
	s.gw = s.gateway("gateway", s.fastURL)
	if s.gwURL, err = s.startProc(ctx, s.gw, "gateway listening"); err != nil {
		return err
	}
	s.b.logf("fake-llm on %s, gateway on %s, database %s", s.fastURL, s.gwURL, s.dbName)
	if c.ProxyBin != "" {
		s.proxy = &cluster.Proc{Name: "bareproxy", Bin: c.ProxyBin, LogDir: c.Dir, Args: []string{"-upstream", s.fastURL}}
		if s.proxyURL, err = s.startProc(ctx, s.proxy, "bareproxy listening"); err != nil {
			return err
		}
		s.b.logf("reference proxy on %s", s.proxyURL)
	}
	if c.ModelLatency > 0 {
		s.model = &cluster.Proc{Name: "fake-llm-model", Bin: c.Bin, LogDir: c.Dir,
			Args: []string{"fake-llm", "--addr", "127.0.0.1:0", "--seed", "16", "--latency", c.ModelLatency.String()}}
		if s.modelURL, err = s.startProc(ctx, s.model, "fake-llm listening"); err != nil {
			return err
		}
		s.gwModel = s.gateway("gateway-model", s.modelURL)
		if s.gwModelURL, err = s.startProc(ctx, s.gwModel, "gateway listening"); err != nil {
			return err
		}
		s.b.logf("fake-llm taking %v on %s, gateway on %s", c.ModelLatency, s.modelURL, s.gwModelURL)
	}
	return nil
}

// target is a setting of the throughput measurement: an upstream, and the process in
// front of it whose cost is measured.
type target struct {
	setting     string // Setting* of ThroughputResult
	concurrency int
	direct      string // base URL of the upstream
	upstream    *cluster.Proc
	via         string // base URL of the process in front of it
	proxy       *cluster.Proc
	keyed       bool // whether the process in front records keyed requests (a gateway)
}

// targets returns the throughput settings of the stack: the gateway in front of the
// upstream that answers at once; the reference proxy in front of the same; the gateway
// in front of the model-like upstream.
func (s *stack) targets() []target {
	c := s.b.cfg
	out := []target{{SettingAtOnce, c.Concurrency, s.fastURL, s.fast, s.gwURL, s.gw, true}}
	if s.proxy != nil {
		out = append(out, target{SettingBareProxy, c.Concurrency, s.fastURL, s.fast, s.proxyURL, s.proxy, false})
	}
	if s.gwModel != nil {
		out = append(out, target{SettingModel, c.ModelConcurrency, s.modelURL, s.model, s.gwModelURL, s.gwModel, true})
	}
	return out
}

// startJoin starts the join measurement's dripping fake-llm and its two gateways.
func (s *stack) startJoin(ctx context.Context) (err error) {
	c := s.b.cfg
	s.drip = &cluster.Proc{Name: "fake-llm-drip", Bin: c.Bin, LogDir: c.Dir,
		Args: []string{"fake-llm", "--addr", "127.0.0.1:0", "--seed", "16", "--drip", "1", "--drip-interval", c.DripInterval.String()}}
	dripURL, err := s.startProc(ctx, s.drip, "fake-llm listening")
	if err != nil {
		return err
	}
	s.joinA = s.gateway("gateway-join-a", dripURL)
	s.joinB = s.gateway("gateway-join-b", dripURL)
	if s.joinAURL, err = s.startProc(ctx, s.joinA, "gateway listening"); err != nil {
		return err
	}
	if s.joinBURL, err = s.startProc(ctx, s.joinB, "gateway listening"); err != nil {
		return err
	}
	s.b.logf("dripping fake-llm on %s, gateways on %s and %s", dripURL, s.joinAURL, s.joinBURL)
	return nil
}

// gateway returns (unstarted) a gateway process named name in front of the fake-llm at
// upstream, on the benchmark's database.
func (s *stack) gateway(name, upstream string) *cluster.Proc {
	env := []string{
		"ONCEFLOW_DATABASE_URL=" + s.dbURL,
		"ONCEFLOW_LLM_BASE_URL=" + upstream + "/v1",
		"ONCEFLOW_GATEWAY_ADDR=127.0.0.1:0",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=5s",
	}
	return &cluster.Proc{Name: name, Bin: s.b.cfg.Bin, LogDir: s.b.cfg.Dir, Args: []string{"gateway"}, Env: append(env, s.b.cfg.GatewayEnv...)}
}

// startProc starts p and returns http:// and the address of its log line msg.
func (s *stack) startProc(ctx context.Context, p *cluster.Proc, msg string) (string, error) {
	if err := p.Start(); err != nil {
		return "", err
	}
	wctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	addr, err := p.Addr(wctx, msg)
	if err != nil {
		return "", fmt.Errorf("%s: %w (log: %s)", p.Name, err, p.LogPath())
	}
	return "http://" + addr, nil
}

// createDatabase creates the benchmark's database on Config.DatabaseURL and sets s.dbURL
// to a URL naming it.
func (s *stack) createDatabase(ctx context.Context) error {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	name := "gatewaybench_" + hex.EncodeToString(rnd[:])
	conn, err := pgx.Connect(ctx, s.b.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return fmt.Errorf("create database: %w", err)
	}
	s.dbName = name
	u, err := url.Parse(s.b.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("parse database url: %w", err)
	}
	u.Path = "/" + name
	s.dbURL = u.String()
	return nil
}

// close stops every process (SIGTERM) and drops the database. The logs stay in
// Config.Dir.
func (s *stack) close() {
	var wg sync.WaitGroup
	for _, p := range []*cluster.Proc{s.gw, s.gwModel, s.proxy, s.joinA, s.joinB} {
		if p != nil {
			wg.Go(func() { p.Stop(10 * time.Second) })
		}
	}
	wg.Wait()
	for _, p := range []*cluster.Proc{s.fast, s.model, s.drip} {
		if p != nil {
			p.Stop(10 * time.Second)
		}
	}
	s.client.CloseIdleConnections()
	if s.pool != nil {
		s.pool.Close()
	}
	if s.dbName != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if conn, err := pgx.Connect(ctx, s.b.cfg.DatabaseURL); err == nil {
			_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+s.dbName+" WITH (FORCE)")
			_ = conn.Close(ctx)
		}
	}
}

// backendCPU returns the CPU time so far of each PostgreSQL backend connected to the
// benchmark's database (the gateways' pools), by process id, read on conn, whose own
// backend it leaves out.
func (s *stack) backendCPU(ctx context.Context, conn *pgx.Conn) (map[int]time.Duration, error) {
	rows, err := conn.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", s.dbName)
	if err != nil {
		return nil, err
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, err
	}
	out := make(map[int]time.Duration, len(pids))
	for _, pid := range pids {
		out[int(pid)] = cluster.CPUTime(int(pid))
	}
	return out, nil
}

// cpuSince returns the CPU time the backends of now spent since before, counting a
// backend that was not in before from its start.
func cpuSince(before, now map[int]time.Duration) time.Duration {
	var d time.Duration
	for pid, t := range now {
		d += t - before[pid]
	}
	return d
}
