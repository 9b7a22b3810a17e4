package onceflow_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The runnable examples are user code to copy: no file that declares an Example
// function imports a package a program outside this module cannot import
// (github.com/onceflow/onceflow/internal/...).
func TestExamplesImportNothingInternal(t *testing.T) {
	const internal = "github.com/onceflow/onceflow/internal/"
	fset := token.NewFileSet()
	examples := 0
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != "." && (name == "testdata" || strings.HasPrefix(name, ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		hasExample := false
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil && strings.HasPrefix(fn.Name.Name, "Example") {
				hasExample = true
			}
		}
		if !hasExample {
			return nil
		}
		examples++
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); strings.HasPrefix(p, internal) {
				t.Errorf("%s: an example file imports %s, which users cannot import", path, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if examples < 5 {
		t.Fatalf("found %d example files; the walk is broken", examples)
	}
}
