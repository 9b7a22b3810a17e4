// Package redisscript is the machinery of onceflow's Redis scripts, in one place. Each
// package keeps its scripts as .lua files next to its code, embedded (go:embed), and
// loads them with a Set; this package reads each file's header, checks every call
// against it, and composes scripts from Lua functions, so that a script that must run
// another package's write in its own atomic step (the idempotency accept, which runs
// the queue's enqueue) calls the function that package owns, never a copy of its text.
// No package exports Lua source: what crosses a package boundary is a Function (an
// opaque handle) or a Step (a Function with its keys and args).
//
// # Files
//
// A script file is a whole script. A library file defines local functions that scripts
// include: its top level is "local function name(...)" definitions only, each closed by
// an unindented "end". A template is a script that calls one function it does not
// define (its slot), filled per call by a Function: Template.With composes the two.
//
// Every file starts with its header: comment lines ("--") from the top, after an
// optional shebang line ("#!lua"), with these lines (the KEYS and ARGV lines indented
// by at least two spaces after the "--"):
//
//	--   KEYS[1]  what the first key is          (one line per key, numbered from 1)
//	--   KEYS[2]  (optional) ...                 (it and the keys after it may be left out)
//	--   KEYS[3:] ...                            (any number of keys from here on, last)
//	--   KEYS     none ...                       (it takes no keys)
//	--   ARGV[...] the same for the arguments
//	-- Returns ...                               (the reply)
//	-- ... Invariant: ...                        (what the script keeps true)
//
// A library's header describes its functions' parameters: keys and argv as KEYS and
// ARGV above when a function takes (keys, argv), or "KEYS none" and "ARGV none" with
// the parameters in words. A template's last, open KEYS and ARGV entries ([n:]) are
// its slot's keys and argv.
//
// # Composition
//
// A composed script is, in order: the main file's shebang, the text of each library it
// includes (each once, its dependencies first), for a template "local <slot> =
// <function>", then the main file's text. Library functions are defined before any of
// the main file's locals, so they see only other libraries and Redis's globals. Each
// script is sent as its SHA-1 (EVALSHA) and, when Redis does not have it cached, as its
// text once (EVAL), as go-redis's redis.Script does.
package redisscript

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// ErrArity is matched by the error of a call whose KEYS or ARGV count is not what the
// script's header names: nothing was sent to Redis.
var ErrArity = errors.New("redisscript: the call does not pass the keys or args the script's header names")

// Set is one package's scripts: its embedded .lua files and the scripts composed from
// them. Its methods are safe for concurrent use; the Must methods are meant for
// package-level variables and panic on a malformed file, so a bad file fails every test
// of its package at init. Files and Scripts are for that package's tests
// (internal/testenv/scriptcheck).
type Set struct {
	fsys fs.FS

	mu      sync.Mutex
	scripts []*Script
}

// NewSet returns the Set of the .lua files of fsys.
func NewSet(fsys fs.FS) *Set {
	return &Set{fsys: fsys}
}

// read returns the text of file p of the set and its header.
func (s *Set) read(p string) (string, Header, error) {
	b, err := fs.ReadFile(s.fsys, p)
	if err != nil {
		return "", Header{}, fmt.Errorf("redisscript: %w", err)
	}
	src := string(b)
	h, err := ParseHeader(src)
	if err != nil {
		return "", Header{}, fmt.Errorf("redisscript: %s: %w", p, err)
	}
	return src, h, nil
}

func (s *Set) add(sc *Script) *Script {
	if s != nil {
		s.mu.Lock()
		s.scripts = append(s.scripts, sc)
		s.mu.Unlock()
	}
	return sc
}

// Scripts returns every script of the set so far: those loaded, and those composed
// (Function.Script, Template.With) until now.
func (s *Set) Scripts() []*Script {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.scripts)
}

// Files returns the paths of the .lua files of the set's file system, in lexical order.
func (s *Set) Files() ([]string, error) {
	var out []string
	err := fs.WalkDir(s.fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && path.Ext(p) == ".lua" {
			out = append(out, p)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("redisscript: list the .lua files: %w", err)
	}
	return out, nil
}

// Lib is a library file: local functions that scripts include (see the package doc).
type Lib struct {
	set    *Set
	path   string
	src    string
	header Header
	funcs  []string
	deps   []*Lib
}

// MustLib loads the library file p, whose functions call those of deps.
func (s *Set) MustLib(p string, deps ...*Lib) *Lib {
	src, h, err := s.read(p)
	if err == nil && strings.HasPrefix(src, "#!") {
		err = fmt.Errorf("redisscript: %s: a library has no shebang (the script that includes it has)", p)
	}
	var funcs []string
	if err == nil {
		if funcs, err = libFunctions(src); err != nil {
			err = fmt.Errorf("redisscript: %s: %w", p, err)
		}
	}
	if err != nil {
		panic(err)
	}
	return &Lib{set: s, path: p, src: src, header: h, funcs: funcs, deps: deps}
}

// Func returns the function name of l, which takes (keys, argv) as l's header describes
// them. It panics when l does not define name.
func (l *Lib) Func(name string) *Function {
	if !slices.Contains(l.funcs, name) {
		panic(fmt.Sprintf("redisscript: %s defines no function %s", l.path, name))
	}
	return &Function{lib: l, name: name, id: l.path + ":" + name, keys: l.header.Keys, args: l.header.Args}
}

// order returns libs and their dependencies, each once, every library after those it
// depends on.
func order(libs []*Lib) []*Lib {
	var out []*Lib
	var visit func(l *Lib)
	visit = func(l *Lib) {
		if slices.Contains(out, l) {
			return
		}
		for _, d := range l.deps {
			visit(d)
		}
		out = append(out, l)
	}
	for _, l := range libs {
		visit(l)
	}
	return out
}

// compose assembles a script (see the package doc).
func compose(main string, libs []*Lib, bind string) string {
	var b strings.Builder
	if strings.HasPrefix(main, "#!") {
		line, rest, _ := strings.Cut(main, "\n")
		b.WriteString(line + "\n")
		main = rest
	}
	for _, l := range order(libs) {
		b.WriteString(l.src)
		if !strings.HasSuffix(l.src, "\n") {
			b.WriteString("\n")
		}
	}
	b.WriteString(bind)
	b.WriteString(main)
	return b.String()
}

// Function is a Lua function of (keys, argv) that a library defines: run alone
// (Script) or in a template's slot (Step, Template.With). It is an opaque handle: its
// owner exports it, or Steps of it, and never its text.
type Function struct {
	lib        *Lib
	name       string
	id         string // "<library path>:<name>", for errors and script names
	keys, args Arity

	once   sync.Once
	script *Script
}

// Name returns the function's Lua name.
func (f *Function) Name() string { return f.name }

// Script returns the script that runs f with KEYS and ARGV as its keys and argv
// ("return f(KEYS, ARGV)"), checked against f's library's header.
func (f *Function) Script() *Script {
	f.once.Do(func() {
		src := compose("return "+f.name+"(KEYS, ARGV)\n", []*Lib{f.lib}, "")
		h := Header{Keys: f.keys, Args: f.args, Reply: f.lib.header.Reply, Invariant: f.lib.header.Invariant}
		f.script = f.lib.set.add(newScript(f.id, "", []*Lib{f.lib}, src, h))
	})
	return f.script
}

// Step returns f applied to keys and args, for a template's slot. An error matching
// ErrArity means their counts are not what f's header names.
func (f *Function) Step(keys []string, args ...any) (Step, error) {
	if err := checkArity(f.id, f.keys, f.args, len(keys), len(args)); err != nil {
		return Step{}, err
	}
	return Step{fn: f, keys: keys, args: args}, nil
}

// LegacyFunction returns a Function named name whose body is the Lua text body, of
// parameters (keys, argv), with no header: its calls are not checked. It exists only
// for the deprecated APIs that took a Lua body as a string; call it once per body and
// keep the result, since Template.With composes one script per Function.
func LegacyFunction(name, body string) *Function {
	src := "local function " + name + "(keys, argv)\n" + body + "\nend\n"
	l := &Lib{path: "(" + name + ")", src: src, funcs: []string{name}}
	return &Function{lib: l, name: name, id: l.path + ":" + name, keys: unbounded, args: unbounded}
}

// Step is a Function with the keys and args of one call, made by the package that owns
// the function (such as queue.EnqueueStep) and run by a template of another (the
// accept of redisstore) in its slot. The zero Step has no function.
type Step struct {
	fn   *Function
	keys []string
	args []any
}

// Function returns the step's function (nil for the zero Step).
func (s Step) Function() *Function { return s.fn }

// Keys returns the step's keys; the caller must not modify them.
func (s Step) Keys() []string { return s.keys }

// Args returns the step's args; the caller must not modify them.
func (s Step) Args() []any { return s.args }

// Template is a script file that calls a function it does not define, its slot,
// filled by Template.With (see the package doc).
type Template struct {
	set    *Set
	path   string
	slot   string
	src    string
	header Header
	libs   []*Lib

	scripts sync.Map // *Function -> *Script
}

// MustTemplate loads the template file p, whose slot is the function named slot, and
// which includes libs.
func (s *Set) MustTemplate(p, slot string, libs ...*Lib) *Template {
	src, h, err := s.read(p)
	if err == nil && (h.Keys.Max >= 0 || h.Args.Max >= 0) {
		err = fmt.Errorf("redisscript: %s: a template's header ends KEYS and ARGV with the slot's ([n:])", p)
	}
	if err != nil {
		panic(err)
	}
	return &Template{set: s, path: p, slot: slot, src: src, header: h, libs: libs}
}

// With returns t composed with f in its slot: the script whose KEYS and ARGV are t's own
// followed by those of a Step of f. It is composed once per f and kept.
func (t *Template) With(f *Function) *Script {
	if sc, ok := t.scripts.Load(f); ok {
		return sc.(*Script)
	}
	bind := ""
	if f.name != t.slot {
		bind = "local " + t.slot + " = " + f.name + "\n"
	}
	libs := append(slices.Clone(t.libs), f.lib)
	src := compose(t.src, libs, bind)
	h := t.header
	h.Keys, h.Args = h.Keys.plus(f.keys), h.Args.plus(f.args)
	sc, loaded := t.scripts.LoadOrStore(f, newScript(t.path+"("+f.id+")", t.path, libs, src, h))
	if !loaded {
		t.set.add(sc.(*Script))
	}
	return sc.(*Script)
}

// Script is a script ready to run: one file, or a composition (see the package doc).
type Script struct {
	name   string
	files  []string
	header Header
	rs     *redis.Script
}

// newScript returns the script of text src, made of the files main and libs (and their
// dependencies).
func newScript(name, main string, libs []*Lib, src string, h Header) *Script {
	files := []string{}
	if main != "" {
		files = append(files, main)
	}
	for _, l := range order(libs) {
		files = append(files, l.path)
	}
	return &Script{name: name, files: files, header: h, rs: redis.NewScript(src)}
}

// MustScript loads the script file p, which includes libs.
func (s *Set) MustScript(p string, libs ...*Lib) *Script {
	src, h, err := s.read(p)
	if err != nil {
		panic(err)
	}
	return s.add(newScript(p, p, libs, compose(src, libs, ""), h))
}

// Name returns the script's file (and for a composition, what it is composed of).
func (s *Script) Name() string { return s.name }

// Files returns the paths of the files the script is made of: its main file (none for a
// Function's script) and its libraries.
func (s *Script) Files() []string { return slices.Clone(s.files) }

// Header returns the script's header; a composition's Keys and Args are its whole
// call's.
func (s *Script) Header() Header { return s.header }

// Hash returns the script's SHA-1, which EVALSHA names it by.
func (s *Script) Hash() string { return s.rs.Hash() }

// Check returns an error matching ErrArity when keys or args are not the number the
// script's header names.
func (s *Script) Check(keys []string, args []any) error {
	return checkArity(s.name, s.header.Keys, s.header.Args, len(keys), len(args))
}

func checkArity(name string, keys, args Arity, nkeys, nargs int) error {
	if !keys.fits(nkeys) {
		return fmt.Errorf("%w: %s takes %s keys, not %d", ErrArity, name, keys, nkeys)
	}
	if !args.fits(nargs) {
		return fmt.Errorf("%w: %s takes %s args, not %d", ErrArity, name, args, nargs)
	}
	return nil
}

// failed returns a Cmd that carries err, as if Redis had answered it.
func failed(ctx context.Context, err error) *redis.Cmd {
	cmd := redis.NewCmd(ctx)
	cmd.SetErr(err)
	return cmd
}

// Run runs the script with keys and args: EVALSHA, then EVAL once if Redis answers
// NOSCRIPT. A call that does not match the header fails with ErrArity, unsent.
func (s *Script) Run(ctx context.Context, c redis.Scripter, keys []string, args ...any) *redis.Cmd {
	if err := s.Check(keys, args); err != nil {
		return failed(ctx, err)
	}
	return s.rs.Run(ctx, c, keys, args...)
}

// EvalSha sends EVALSHA only (in a pipeline, where the caller handles NOSCRIPT).
func (s *Script) EvalSha(ctx context.Context, c redis.Scripter, keys []string, args ...any) *redis.Cmd {
	if err := s.Check(keys, args); err != nil {
		return failed(ctx, err)
	}
	return s.rs.EvalSha(ctx, c, keys, args...)
}

// Eval sends the script's text (EVAL).
func (s *Script) Eval(ctx context.Context, c redis.Scripter, keys []string, args ...any) *redis.Cmd {
	if err := s.Check(keys, args); err != nil {
		return failed(ctx, err)
	}
	return s.rs.Eval(ctx, c, keys, args...)
}

// Load loads the script into Redis's script cache (SCRIPT LOAD), so that its first run
// is one round trip.
func (s *Script) Load(ctx context.Context, c redis.Scripter) error {
	if err := s.rs.Load(ctx, c).Err(); err != nil {
		return fmt.Errorf("load script %s: %w", s.name, err)
	}
	return nil
}
