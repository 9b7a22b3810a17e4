// Package doccheck checks a package's documentation from its source, for tests: every
// exported function and method has a runnable Example.
package doccheck

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// MissingExamples parses the Go files of dir (tests included, where the Examples are)
// as the package importPath and returns the exported functions and methods ("Name",
// "Type.Method") that have no Example and are not keys of covered (an entry point
// shown by another's example, the value saying which). Parse errors fail t.
func MissingExamples(t testing.TB, dir, importPath string, covered map[string]string) []string {
	t.Helper()
	fset := token.NewFileSet()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, name := range names {
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	p, err := doc.NewFromFiles(fset, files, importPath)
	if err != nil {
		t.Fatal(err)
	}
	var missing []string
	check := func(name, comment string, examples []*doc.Example) {
		if deprecated(comment) {
			return // its doc names the replacement, whose Example shows it
		}
		if len(examples) == 0 && covered[name] == "" {
			missing = append(missing, name)
		}
	}
	for _, f := range p.Funcs {
		check(f.Name, f.Doc, f.Examples)
	}
	for _, ty := range p.Types {
		for _, f := range ty.Funcs {
			check(f.Name, f.Doc, f.Examples)
		}
		for _, m := range ty.Methods {
			check(ty.Name+"."+m.Name, m.Doc, m.Examples)
		}
	}
	return missing
}

// deprecated reports whether a doc comment has a "Deprecated:" paragraph, the Go
// convention that marks an entry point kept only for old callers.
func deprecated(comment string) bool {
	for _, para := range strings.Split(comment, "\n\n") {
		if strings.HasPrefix(strings.TrimSpace(para), "Deprecated:") {
			return true
		}
	}
	return false
}
