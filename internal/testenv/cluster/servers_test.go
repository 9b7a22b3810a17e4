package cluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The initdb template's name is predictable: a template that someone else made first (a
// folder other users may enter and write, with a configuration of theirs) is refused
// with an error naming it, never copied and started.
func TestInitdbTemplateRefusesAFolderOthersControl(t *testing.T) {
	initdb := filepath.Join(t.TempDir(), "initdb") // a binary of the test's own: a name of its own
	if err := os.WriteFile(initdb, []byte("#!/bin/sh\nexit 1\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	dir, err := templatePath(initdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "PG_VERSION"), []byte("15\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := initdbTemplate(initdb, nil)
	if err == nil || !strings.Contains(err.Error(), dir) {
		t.Fatalf("initdbTemplate = %q, %v; want an error naming %s", got, err, dir)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if got, err := initdbTemplate(initdb, nil); err != nil || got != dir {
		t.Fatalf("a private template of this user's: %q %v", got, err)
	}
}
