package redisscript

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseHeaderReadsTheArityOfKeysAndArgs(t *testing.T) {
	const tail = "-- Returns 1.\n-- Invariant: x.\nreturn 1\n"
	for _, tc := range []struct {
		name       string
		src        string
		keys, args Arity
	}{
		{"fixed", "--   KEYS[1]  a\n--   KEYS[2]  b\n--   ARGV[1]  c\n" + tail, Arity{2, 2}, Arity{1, 1}},
		{"shebang and none", "#!lua\n-- text\n--   KEYS  none\n--   ARGV  none: a parameter\n" + tail, Arity{0, 0}, Arity{0, 0}},
		{"open", "--   KEYS[1]  a\n--   KEYS[2:] b\n--   ARGV[1:] c\n" + tail, Arity{1, -1}, Arity{0, -1}},
		{"optional", "--   KEYS[1]  a\n--   KEYS[2]  (optional) b\n--   ARGV[1]  c\n--   ARGV[2]  d\n--   ARGV[3:] e\n" + tail, Arity{1, 2}, Arity{2, -1}},
		{"wrapped prose is not an entry", "--   KEYS[1]  a\n--   ARGV[1]  b\n-- Returns nil when ARGV[1]\n-- ARGV[2] is not an entry: it is one space in.\n-- Invariant: y\n", Arity{1, 1}, Arity{1, 1}},
	} {
		h, err := ParseHeader(tc.src)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if h.Keys != tc.keys || h.Args != tc.args || h.Reply == "" || h.Invariant == "" {
			t.Errorf("%s: got %+v, want keys %v args %v", tc.name, h, tc.keys, tc.args)
		}
	}
}

func TestParseHeaderRefusesAnIncompleteHeader(t *testing.T) {
	for name, src := range map[string]string{
		"no KEYS":            "--   ARGV[1]  a\n-- Returns 1.\n-- Invariant: x\n",
		"no ARGV":            "--   KEYS[1]  a\n-- Returns 1.\n-- Invariant: x\n",
		"no reply":           "--   KEYS[1]  a\n--   ARGV[1]  b\n-- Invariant: x\n",
		"no invariant":       "--   KEYS[1]  a\n--   ARGV[1]  b\n-- Returns 1.\n",
		"a gap":              "--   KEYS[1]  a\n--   KEYS[3]  c\n--   ARGV  none\n-- Returns 1. Invariant: x\n",
		"not from 1":         "--   KEYS[2]  a\n--   ARGV  none\n-- Returns 1. Invariant: x\n",
		"after an open one":  "--   KEYS[1:] a\n--   KEYS[2]  b\n--   ARGV  none\n-- Returns 1. Invariant: x\n",
		"required after opt": "--   KEYS[1]  (optional) a\n--   KEYS[2]  b\n--   ARGV  none\n-- Returns 1. Invariant: x\n",
		"none and an entry":  "--   KEYS  none\n--   KEYS[1]  a\n--   ARGV  none\n-- Returns 1. Invariant: x\n",
		"after the header":   "-- text\n\n--   KEYS[1]  a\n--   ARGV  none\n-- Returns 1. Invariant: x\n",
	} {
		if h, err := ParseHeader(src); err == nil {
			t.Errorf("%s: accepted as %+v", name, h)
		}
	}
}

func TestLibFunctions(t *testing.T) {
	got, err := libFunctions("-- header\nlocal function a(keys, argv)\n  return 1\nend\n\nlocal function b_2(x)\nend\n")
	if err != nil || strings.Join(got, ",") != "a,b_2" {
		t.Fatalf("libFunctions = %v, %v; want [a b_2]", got, err)
	}
	for name, code := range map[string]string{
		"top-level code": "local function a()\nend\nredis.call('DEL', KEYS[1])\n",
		"a global":       "function a()\nend\n",
		"no function":    "-- only a header\n",
	} {
		if _, err := libFunctions(code); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestEveryLuaFileHasAHeader walks the repository: every .lua file names its KEYS,
// ARGV, reply and invariant in its header.
func TestEveryLuaFileHasAHeader(t *testing.T) {
	root := filepath.Join("..", "..")
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("the repository root is not %s: %v", root, err)
	}
	dirs := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || filepath.Ext(p) != ".lua" {
			return nil
		}
		rel, _ := filepath.Rel(root, filepath.Dir(p))
		dirs[filepath.ToSlash(rel)] = true
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if _, err := ParseHeader(string(src)); err != nil {
			t.Errorf("%s: %v", p, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"queue/lua", "limiter/lua", "idempotency/redisstore/lua"} {
		if !dirs[d] {
			t.Errorf("found no .lua file in %s (found some in %v)", d, dirs)
		}
	}
}
