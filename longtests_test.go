package onceflow_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// Every test that `make test` skips (go test -short: testenv.Long, or testing.Short in
// the examples) runs in `make test-long`: named in the Makefile's LONG_TESTS, in a
// package of LONG_PKGS, or in a package that test-long runs whole (the Redis Cluster
// pass). Otherwise CI would run it nowhere.
func TestEveryTestMakeTestSkipsRunsInMakeTestLong(t *testing.T) {
	mk, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	variable := func(name string) string {
		m := regexp.MustCompile(`(?m)^` + name + ` = (.*)$`).FindSubmatch(mk)
		if m == nil {
			t.Fatalf("Makefile: no %s", name)
		}
		return string(m[1])
	}
	names := strings.Split(strings.TrimSuffix(strings.TrimPrefix(variable("LONG_TESTS"), "^("), ")$$"), "|")
	pkgs := strings.Fields(variable("LONG_PKGS"))
	whole := regexp.MustCompile(`ONCEFLOW_TEST_REDIS_CLUSTER=local .* (\./\S+) (\./\S+)\n`).FindSubmatch(mk)
	if whole == nil {
		t.Fatal("Makefile: no test-long run of whole packages on the local Redis Cluster")
	}
	skipping := map[string]bool{}
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (path == "lab" || strings.HasPrefix(d.Name(), ".") && path != ".") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			return err
		}
		pkg := "./" + filepath.ToSlash(filepath.Dir(path))
		if pkg == "./." {
			pkg = "."
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || !strings.HasPrefix(fn.Name.Name, "Test") || fn.Body == nil || !skipsUnderShort(fn.Body) {
				continue
			}
			skipping[fn.Name.Name] = true
			switch {
			case pkg == string(whole[1]) || pkg == string(whole[2]):
			case !slices.Contains(names, fn.Name.Name):
				t.Errorf("%s (%s) is skipped by make test and not in the Makefile's LONG_TESTS: CI never runs it", fn.Name.Name, path)
			case !slices.Contains(pkgs, pkg):
				t.Errorf("%s is in LONG_TESTS, but its package %s is not in LONG_PKGS: CI never runs it", fn.Name.Name, pkg)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if !skipping[name] {
			t.Errorf("LONG_TESTS names %s, which is gone or runs in make test too (no testenv.Long or testing.Short)", name)
		}
	}
}

// skipsUnderShort reports whether body calls testenv.Long or testing.Short.
func skipsUnderShort(body *ast.BlockStmt) bool {
	skips := false
	ast.Inspect(body, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		if sel, ok := call.Fun.(*ast.SelectorExpr); ok {
			if x, ok := sel.X.(*ast.Ident); ok && (x.Name == "testenv" && sel.Sel.Name == "Long" || x.Name == "testing" && sel.Sel.Name == "Short") {
				skips = true
			}
		}
		return !skips
	})
	return skips
}
