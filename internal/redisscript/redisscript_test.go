package redisscript

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/testenv/roundtrip"
)

const (
	addLua = `-- add(keys, argv) adds to a counter.
--   KEYS[1]  the counter
--   ARGV[1]  the increment
-- Returns the new value.
-- Invariant: one INCRBY.
local function add(keys, argv)
  return redis.call('INCRBY', keys[1], argv[1])
end
`
	twiceLua = `-- twice(keys, argv) adds twice, with add.lua.
--   KEYS[1]  the counter
--   ARGV[1]  the increment
-- Returns the new value.
-- Invariant: two INCRBYs.
local function twice(keys, argv)
  add(keys, argv)
  return add(keys, argv)
end
`
	peekLua = `-- peek(keys, argv) reads a local of the template that runs it: it must not see it.
--   KEYS     none
--   ARGV     none
-- Returns the local's type.
-- Invariant: none written.
local function peek(keys, argv)
  return type(secret)
end
`
	logLua = `#!lua
-- log.lua: appends ARGV[1] to a list, then runs step(keys, argv) with the rest.
--   KEYS[1]  the list
--   KEYS[2:] the step's keys
--   ARGV[1]  the entry
--   ARGV[2:] the step's args
-- Returns {entry, the step's reply}.
-- Invariant: the entry and the step's writes are one script.
local secret = 'a local of the template'
redis.call('RPUSH', KEYS[1], ARGV[1])
local wkeys, wargv = {}, {}
for i = 2, #KEYS do wkeys[#wkeys + 1] = KEYS[i] end
for i = 2, #ARGV do wargv[#wargv + 1] = ARGV[i] end
return {ARGV[1], step(wkeys, wargv)}
`
	mainLua = `-- main.lua: add with KEYS and ARGV.
--   KEYS[1]  the counter
--   ARGV[1]  the increment
-- Returns the new value.
-- Invariant: as add.lua.
return add(KEYS, ARGV)
`
)

func testSet() *Set {
	return NewSet(fstest.MapFS{
		"lua/add.lua":   {Data: []byte(addLua)},
		"lua/twice.lua": {Data: []byte(twiceLua)},
		"lua/peek.lua":  {Data: []byte(peekLua)},
		"lua/log.lua":   {Data: []byte(logLua)},
		"lua/main.lua":  {Data: []byte(mainLua)},
		"README":        {Data: []byte("not a script")},
	})
}

// TestCompositionRunsTheOwnersFunctions: a script, a function run alone and a template
// composed with a function of a library that depends on another all run on Redis, with
// their keys and args where the headers say; a call that does not match a header is
// refused before anything is sent.
func TestCompositionRunsTheOwnersFunctions(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	var rt roundtrip.Counter
	rdb.AddHook(&rt)
	ctx := context.Background()
	set := testSet()
	add := set.MustLib("lua/add.lua")
	twice := set.MustLib("lua/twice.lua", add).Func("twice")
	peek := set.MustLib("lua/peek.lua").Func("peek")
	main := set.MustScript("lua/main.lua", add)
	log := set.MustTemplate("lua/log.lua", "step")
	counter, list := prefix+":counter", prefix+":list"

	if n, err := main.Run(ctx, rdb, []string{counter}, 2).Int(); err != nil || n != 2 {
		t.Fatalf("main.lua = %d, %v; want 2", n, err)
	}
	if n, err := add.Func("add").Script().Run(ctx, rdb, []string{counter}, 3).Int(); err != nil || n != 5 {
		t.Fatalf("add alone = %d, %v; want 5", n, err)
	}
	step, err := twice.Step([]string{counter}, 10)
	if err != nil {
		t.Fatal(err)
	}
	sc := log.With(step.Function())
	if log.With(twice) != sc {
		t.Error("With composed a second script for the same function")
	}
	keys := append([]string{list}, step.Keys()...)
	args := append([]any{"first"}, step.Args()...)
	res, err := sc.Run(ctx, rdb, keys, args...).Slice()
	if err != nil || len(res) != 2 || res[0] != "first" || res[1] != int64(25) {
		t.Fatalf("log.lua with twice = %v, %v; want [first 25]", res, err)
	}
	if got := rdb.LRange(ctx, list, 0, -1).Val(); !slices.Equal(got, []string{"first"}) {
		t.Errorf("the template's own write: %v", got)
	}
	if files := sc.Files(); !slices.Equal(files, []string{"lua/log.lua", "lua/add.lua", "lua/twice.lua"}) {
		t.Errorf("the composition is made of %v", files)
	}

	// The function sees none of the template's locals: Redis refuses the read of an
	// unknown global.
	if err := log.With(peek).Run(ctx, rdb, []string{list}, "peek").Err(); err == nil || !strings.Contains(err.Error(), "nonexistent global variable 'secret'") {
		t.Errorf("a function read a local of its template: %v", err)
	}

	// A call that does not match a header is refused, unsent.
	before := rt.Redis()
	for name, err := range map[string]error{
		"too many keys":     main.Run(ctx, rdb, []string{counter, list}, 1).Err(),
		"no args":           main.Run(ctx, rdb, []string{counter}).Err(),
		"composed, 2 keys":  sc.Run(ctx, rdb, []string{list, counter, counter}, "x", 1).Err(),
		"composed, EvalSha": sc.EvalSha(ctx, rdb, []string{list}, "x", 1).Err(),
		"composed, Eval":    sc.Eval(ctx, rdb, []string{list, counter}, "x").Err(),
	} {
		if !errors.Is(err, ErrArity) {
			t.Errorf("%s: %v, want ErrArity", name, err)
		}
	}
	if _, err := twice.Step([]string{counter, list}, 1); !errors.Is(err, ErrArity) {
		t.Errorf("a Step with two keys for a function of one: %v, want ErrArity", err)
	}
	if n := rt.Redis() - before; n != 0 {
		t.Errorf("refused calls made %d round trips", n)
	}

	// A deprecated Lua body runs in the slot unchecked.
	legacy := LegacyFunction("step", "return redis.call('GET', keys[1])")
	step, _ = legacy.Step([]string{counter})
	if res, err := log.With(step.Function()).Run(ctx, rdb, append([]string{list}, step.Keys()...), "legacy").Slice(); err != nil || res[1] != "25" {
		t.Errorf("a legacy body = %v, %v; want [legacy 25]", res, err)
	}

	if err := sc.Load(ctx, rdb); err != nil {
		t.Fatal(err)
	}
	if ok, _ := rdb.ScriptExists(ctx, sc.Hash()).Result(); len(ok) != 1 || !ok[0] {
		t.Error("Load did not load the composed script")
	}
	var names []string
	for _, s := range set.Scripts() {
		names = append(names, s.Name())
	}
	for _, want := range []string{"lua/main.lua", "lua/add.lua:add", "lua/log.lua(lua/twice.lua:twice)", "lua/log.lua(lua/peek.lua:peek)", "lua/log.lua((step):step)"} {
		if !slices.Contains(names, want) {
			t.Errorf("Scripts() = %v, missing %s", names, want)
		}
	}
	if files, err := set.Files(); err != nil || len(files) != 5 {
		t.Errorf("Files() = %v, %v; want the 5 .lua files", files, err)
	}
}

func TestMustRefusesMalformedFiles(t *testing.T) {
	set := NewSet(fstest.MapFS{
		"bad-lib.lua":      {Data: []byte("--   KEYS none\n--   ARGV none\n-- Returns 1. Invariant: x\nlocal function a()\nend\nreturn 1\n")},
		"shebang-lib.lua":  {Data: []byte("#!lua\n" + addLua)},
		"closed.lua":       {Data: []byte(mainLua)},
		"no-header.lua":    {Data: []byte("return 1\n")},
		"lua/add.lua":      {Data: []byte(addLua)},
		"unknown-func.lua": {Data: []byte(addLua)},
	})
	for name, f := range map[string]func(){
		"code in a library":       func() { set.MustLib("bad-lib.lua") },
		"a library with shebang":  func() { set.MustLib("shebang-lib.lua") },
		"a template with no slot": func() { set.MustTemplate("closed.lua", "step") },
		"a script with no header": func() { set.MustScript("no-header.lua") },
		"a missing file":          func() { set.MustScript("nothing.lua") },
		"an undefined function":   func() { set.MustLib("unknown-func.lua").Func("sub") },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}
