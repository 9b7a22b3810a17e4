package redisstore

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/internal/redisscript"
	"github.com/onceflow/onceflow/queue"
)

// acceptFixture is a summaries-like accept: the queue's stream entry format (v, job_id,
// tenant, payload, enqueued_at, traceparent) and its job index hash.
type acceptFixture struct {
	s      *Store
	stream string
	index  string
}

func newAcceptFixture(t *testing.T, cfg Config) (*acceptFixture, func() int64) {
	t.Helper()
	s, c := newTestStore(t, cfg)
	f := &acceptFixture{s: s, stream: s.cfg.Prefix + ":{summaries}:stream", index: s.cfg.Prefix + ":{summaries}:job:11111111-2222-5333-8444-555555555555"}
	return f, c.Redis
}

func (f *acceptFixture) enqueue(body string) Enqueue {
	return Enqueue{
		Stream: f.stream,
		Fields: []any{"v", "1", "job_id", "11111111-2222-5333-8444-555555555555", "tenant", "acme",
			"payload", body, "enqueued_at", strconv.FormatInt(time.Now().UnixMilli(), 10), "traceparent", ""},
		IndexKey:    f.index,
		IndexFields: []any{"tenant", "acme"},
		IndexTTL:    time.Hour,
	}
}

func accepted() *idempotency.Response {
	return &idempotency.Response{
		Status: http.StatusAccepted,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/summaries/11111111-2222-5333-8444-555555555555"}},
		Body:   []byte(`{"job_id":"11111111-2222-5333-8444-555555555555","status":"queued"}`),
	}
}

func (f *acceptFixture) xlen(t *testing.T) int64 {
	t.Helper()
	n, err := f.s.rdb.XLen(context.Background(), f.stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

const body1 = `{"notify":"a@example.com","text":"hello"}`

func TestAcceptNewThenReplay(t *testing.T) {
	t.Parallel()
	f, rt := newAcceptFixture(t, Config{ResultTTL: time.Hour})
	ctx := context.Background()
	before := rt()
	got, replayed, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1))
	if err != nil || replayed || got.Status != http.StatusAccepted {
		t.Fatalf("first Accept = (%+v, %v, %v), want the new response", got, replayed, err)
	}
	if n := rt() - before; n != 1 {
		t.Errorf("new Accept took %d Redis round trips, want 1", n)
	}
	if n := f.xlen(t); n != 1 {
		t.Fatalf("stream has %d entries, want 1", n)
	}
	entries, _ := f.s.rdb.XRange(ctx, f.stream, "-", "+").Result()
	if v := entries[0].Values; v["job_id"] != "11111111-2222-5333-8444-555555555555" || v["payload"] != body1 || v["v"] != "1" || v["tenant"] != "acme" {
		t.Errorf("stream entry = %v", v)
	}
	if owner, _ := f.s.rdb.HGet(ctx, f.index, "tenant").Result(); owner != "acme" {
		t.Errorf("index tenant = %q, want acme", owner)
	}
	if ttl, _ := f.s.rdb.PTTL(ctx, f.index).Result(); ttl <= 0 || ttl > time.Hour {
		t.Errorf("index TTL = %v, want (0, 1h]", ttl)
	}
	key, _ := f.s.AcceptKey(f.stream, testScope)
	if want := f.s.cfg.Prefix + ":{summaries}:idem:" + testScope.Hash(); key != want {
		t.Errorf("record key %s, want %s", key, want)
	}
	if ttl, _ := f.s.rdb.PTTL(ctx, key).Result(); ttl <= 59*time.Minute || ttl > time.Hour {
		t.Errorf("record TTL = %v, want about the result TTL (1h)", ttl)
	}

	before = rt()
	again, replayed, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1))
	if err != nil || !replayed {
		t.Fatalf("second Accept = (%v, %v), want a replay", replayed, err)
	}
	if n := rt() - before; n != 1 {
		t.Errorf("replayed Accept took %d Redis round trips, want 1", n)
	}
	want := accepted()
	if again.Status != want.Status || string(again.Body) != string(want.Body) || again.Header.Get("Location") != want.Header.Get("Location") {
		t.Errorf("replayed %+v, want %+v", again, want)
	}
	if n := f.xlen(t); n != 1 {
		t.Fatalf("replay added to the stream: %d entries", n)
	}
}

func TestAcceptDifferentBodyIsReused(t *testing.T) {
	t.Parallel()
	f, _ := newAcceptFixture(t, Config{})
	ctx := context.Background()
	if _, _, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1)); err != nil {
		t.Fatal(err)
	}
	other := "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
	_, _, err := f.s.Accept(ctx, testScope, other, accepted(), f.enqueue(`{"text":"other"}`))
	if !errors.Is(err, idempotency.ErrKeyReused) {
		t.Fatalf("Accept with another fingerprint: %v, want ErrKeyReused", err)
	}
	if n := f.xlen(t); n != 1 {
		t.Fatalf("a reused key enqueued: %d entries, want 1", n)
	}
}

// TestAcceptBurstEnqueuesOnce: 200 concurrent Accepts of one key and body enqueue
// exactly once; every other call replays the same response.
func TestAcceptBurstEnqueuesOnce(t *testing.T) {
	t.Parallel()
	f, _ := newAcceptFixture(t, Config{})
	const n = 200
	var (
		wg             sync.WaitGroup
		mu             sync.Mutex
		fresh, replays int
	)
	start := make(chan struct{})
	for range n {
		wg.Go(func() {
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			got, replayed, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				t.Errorf("Accept: %v", err)
			case replayed:
				replays++
				if string(got.Body) != string(accepted().Body) {
					t.Errorf("replayed body %q", got.Body)
				}
			default:
				fresh++
			}
		})
	}
	close(start)
	wg.Wait()
	if fresh != 1 || replays != n-1 {
		t.Fatalf("%d new and %d replays, want 1 and %d", fresh, replays, n-1)
	}
	if got := f.xlen(t); got != 1 {
		t.Fatalf("stream has %d entries after a burst of %d, want 1", got, n)
	}
}

// TestAcceptSeesGenericInProgress: when generic records share the stream's slot
// (Config.HashTag), a key held by an in-progress generic request is ErrInProgress.
func TestAcceptSeesGenericInProgress(t *testing.T) {
	t.Parallel()
	f, _ := newAcceptFixture(t, Config{HashTag: "summaries"})
	ctx := context.Background()
	if l, _, err := f.s.Claim(ctx, testScope, testFP, time.Minute); err != nil || l == nil {
		t.Fatalf("Claim: %v", err)
	}
	if _, _, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1)); !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("Accept over an in-progress marker: %v, want ErrInProgress", err)
	}
	if n := f.xlen(t); n != 0 {
		t.Fatalf("enqueued %d entries over an in-progress marker", n)
	}
}

// TestAcceptRejectsBadEnqueue: invalid input is an error before anything is written.
func TestAcceptRejectsBadEnqueue(t *testing.T) {
	t.Parallel()
	f, _ := newAcceptFixture(t, Config{})
	ctx := context.Background()
	bad := map[string]func(e *Enqueue){
		"stream without hash tag": func(e *Enqueue) { e.Stream = f.s.cfg.Prefix + ":stream" },
		"index in another slot":   func(e *Enqueue) { e.IndexKey = f.s.cfg.Prefix + ":{other}:job:1" },
		"odd fields":              func(e *Enqueue) { e.Fields = e.Fields[:3] },
		"no fields":               func(e *Enqueue) { e.Fields = nil },
		"odd index fields":        func(e *Enqueue) { e.IndexFields = []any{"tenant"} },
		"index fields, no key":    func(e *Enqueue) { e.IndexKey = "" },
		"negative index TTL":      func(e *Enqueue) { e.IndexTTL = -time.Second },
	}
	for name, mutate := range bad {
		e := f.enqueue(body1)
		mutate(&e)
		if _, _, err := f.s.Accept(ctx, testScope, testFP, accepted(), e); err == nil {
			t.Errorf("%s: Accept succeeded", name)
		}
	}
	if _, _, err := f.s.Accept(ctx, testScope, "bad\nfingerprint", accepted(), f.enqueue(body1)); err == nil {
		t.Error("a fingerprint with a newline was accepted")
	}
	keys, _ := f.s.rdb.Keys(ctx, f.s.cfg.Prefix+":*").Result()
	if len(keys) != 0 {
		t.Fatalf("rejected Accepts wrote %v", keys)
	}
}

// TestAcceptWrongTypeWritesNothing: a runtime error inside the script (the stream key
// holds another type) fails before any write, so the key is not marked as accepted.
func TestAcceptWrongTypeWritesNothing(t *testing.T) {
	t.Parallel()
	f, _ := newAcceptFixture(t, Config{})
	ctx := context.Background()
	if err := f.s.rdb.Set(ctx, f.stream, "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.s.Accept(ctx, testScope, testFP, accepted(), f.enqueue(body1)); err == nil {
		t.Fatal("Accept onto a string key succeeded")
	}
	key, _ := f.s.AcceptKey(f.stream, testScope)
	for _, k := range []string{key, f.index} {
		if n, _ := f.s.rdb.Exists(ctx, k).Result(); n != 0 {
			t.Errorf("%s was written by a failed Accept", k)
		}
	}
}

func TestHashTagFollowsRedisClusterRules(t *testing.T) {
	for key, want := range map[string]string{
		"p:{summaries}:stream": "summaries",
		"{a}{b}":               "a",
		"p:{}:x":               "",
		"p:x":                  "",
		"p:{x":                 "",
		"p:}{x}":               "x",
	} {
		got, ok := hashTag(key)
		if got != want || ok != (want != "") {
			t.Errorf("hashTag(%q) = %q, %v; want %q", key, got, ok, want)
		}
	}
}

// TestAcceptWriteRunsTheOwnersLua: the deprecated AcceptWrite still runs a Write's Lua
// body (here a counter and a list in one slot, with the keys and args as given) once
// per key, in one round trip once LoadScripts loaded it; replays do not run it; an
// error the Lua raises stores nothing; keys in two slots are refused.
func TestAcceptWriteRunsTheOwnersLua(t *testing.T) {
	t.Parallel()
	s, c := newTestStore(t, Config{ResultTTL: time.Hour})
	ctx := context.Background()
	counter, list := s.cfg.Prefix+":{w}:count", s.cfg.Prefix+":{w}:list"
	const lua = `
if argv[1] == 'fail' then error({err = 'ERR refused'}) end
redis.call('INCR', keys[1])
redis.call('RPUSH', keys[2], argv[1], argv[2])
return 'ok'
`
	if err := s.LoadScripts(ctx, lua); err != nil {
		t.Fatal(err)
	}
	w := Write{Lua: lua, Keys: []string{counter, list}, Args: []any{"a", "b"}}
	before := c.Redis()
	got, replayed, err := s.AcceptWrite(ctx, testScope, testFP, accepted(), w)
	if err != nil || replayed || got.Status != http.StatusAccepted {
		t.Fatalf("AcceptWrite = (%+v, %v, %v), want the new response", got, replayed, err)
	}
	if n := c.Redis() - before; n != 1 {
		t.Errorf("AcceptWrite took %d round trips, want 1", n)
	}
	if _, replayed, err := s.AcceptWrite(ctx, testScope, testFP, accepted(), w); err != nil || !replayed {
		t.Fatalf("second AcceptWrite = (%v, %v), want a replay", replayed, err)
	}
	if n, _ := s.rdb.Get(ctx, counter).Int(); n != 1 {
		t.Errorf("the Write ran %d times, want 1", n)
	}
	if l := s.rdb.LRange(ctx, list, 0, -1).Val(); len(l) != 2 || l[0] != "a" || l[1] != "b" {
		t.Errorf("the Write got args %v, want [a b]", l)
	}
	key, _ := s.AcceptKey(counter, testScope)
	if ttl := s.rdb.PTTL(ctx, key).Val(); ttl <= 59*time.Minute {
		t.Errorf("record %s TTL %v, want about the result TTL in the Write's slot", key, ttl)
	}

	other := idempotency.Scope{Tenant: "acme", Method: "POST", Path: "/x", Key: "another-key-0123456789"}
	if _, _, err := s.AcceptWrite(ctx, other, testFP, accepted(), Write{Lua: lua, Keys: w.Keys, Args: []any{"fail", "x"}}); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("AcceptWrite with a Lua error = %v, want the error", err)
	}
	if k, _ := s.AcceptKey(counter, other); s.rdb.Exists(ctx, k).Val() != 0 {
		t.Error("a failed Write stored a response")
	}
	for name, bad := range map[string]Write{
		"two slots": {Lua: lua, Keys: []string{counter, s.cfg.Prefix + ":{v}:list"}, Args: w.Args},
		"no tag":    {Lua: lua, Keys: []string{s.cfg.Prefix + ":count"}},
		"no keys":   {Lua: lua},
		"no Lua":    {Keys: w.Keys},
	} {
		if _, _, err := s.AcceptWrite(ctx, other, testFP, accepted(), bad); err == nil {
			t.Errorf("%s: AcceptWrite succeeded", name)
		}
	}
}

// TestAcceptStepRunsTheOwnersStep: AcceptStep runs the queue's own enqueue (a Step of
// queue.EnqueueStep) once per key, in one round trip once Preload loaded it: the entry
// and the job index as queue.Enqueue writes them; replays do not run it; an error the
// step raises (another tenant's job id) stores nothing; a Step with no function, no
// keys or keys in two slots is refused before anything is sent.
func TestAcceptStepRunsTheOwnersStep(t *testing.T) {
	t.Parallel()
	s, c := newTestStore(t, Config{ResultTTL: time.Hour})
	ctx := context.Background()
	if err := s.Preload(ctx, queue.StepFunctions()...); err != nil {
		t.Fatal(err)
	}
	keys := queue.Keys{Prefix: s.cfg.Prefix, Queue: "summaries"}
	const jobID = "11111111-2222-5333-8444-555555555555"
	step, err := queue.EnqueueStep(keys, queue.Message{JobID: jobID, Tenant: "acme", Payload: []byte(`{"n":1}`)})
	if err != nil {
		t.Fatal(err)
	}
	before := c.Redis()
	got, replayed, err := s.AcceptStep(ctx, testScope, testFP, accepted(), step)
	if err != nil || replayed || got.Status != http.StatusAccepted {
		t.Fatalf("AcceptStep = (%+v, %v, %v), want the new response", got, replayed, err)
	}
	if n := c.Redis() - before; n != 1 {
		t.Errorf("AcceptStep took %d round trips, want 1", n)
	}
	if _, replayed, err := s.AcceptStep(ctx, testScope, testFP, accepted(), step); err != nil || !replayed {
		t.Fatalf("second AcceptStep = (%v, %v), want a replay", replayed, err)
	}
	if n := s.rdb.XLen(ctx, keys.Stream()).Val(); n != 1 {
		t.Errorf("the stream has %d entries, want 1", n)
	}
	ix, err := queue.ReadJobIndex(ctx, s.rdb, keys, jobID)
	if err != nil || ix.Tenant != "acme" || ix.State != queue.StateQueued || ix.Entry == "" {
		t.Errorf("job index = %+v, %v; want acme's, queued, with its entry", ix, err)
	}
	key, _ := s.AcceptKey(keys.Stream(), testScope)
	if ttl := s.rdb.PTTL(ctx, key).Val(); ttl <= 59*time.Minute {
		t.Errorf("record %s TTL %v, want about the result TTL in the queue's slot", key, ttl)
	}

	other := idempotency.Scope{Tenant: "globex", Method: "POST", Path: "/x", Key: "another-key-0123456789"}
	taken, err := queue.EnqueueStep(keys, queue.Message{JobID: jobID, Tenant: "globex", Payload: []byte(`{"n":2}`)})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.AcceptStep(ctx, other, testFP, accepted(), taken); !errors.Is(queue.EnqueueError(err), queue.ErrJobIDTaken) {
		t.Fatalf("AcceptStep of another tenant's job id = %v, want ErrJobIDTaken", err)
	}
	if k, _ := s.AcceptKey(keys.Stream(), other); s.rdb.Exists(ctx, k).Val() != 0 {
		t.Error("a refused step stored a response")
	}
	if n := s.rdb.XLen(ctx, keys.Stream()).Val(); n != 1 {
		t.Errorf("a refused step added to the stream: %d entries", n)
	}

	twoSlots, err := redisscript.LegacyFunction("write", "return 1").Step([]string{keys.Stream(), s.cfg.Prefix + ":{other}:x"})
	if err != nil {
		t.Fatal(err)
	}
	noKeys, _ := redisscript.LegacyFunction("write", "return 1").Step(nil)
	before = c.Redis()
	for name, bad := range map[string]Step{"two slots": twoSlots, "no keys": noKeys, "no function": {}} {
		if _, _, err := s.AcceptStep(ctx, other, testFP, accepted(), bad); err == nil {
			t.Errorf("%s: AcceptStep succeeded", name)
		}
	}
	if n := c.Redis() - before; n != 0 {
		t.Errorf("refused Steps made %d round trips", n)
	}
}
