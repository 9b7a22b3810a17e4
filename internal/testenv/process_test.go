package testenv

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// tinyModule writes a module with one main package and returns its root.
func tinyModule(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	for name, text := range map[string]string{
		"go.mod":  "module tiny\n\ngo 1.22\n",
		"main.go": "package main\n\nfunc main() {}\n",
	} {
		if err := os.WriteFile(filepath.Join(root, name), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// The shared build folder has a predictable name under the shared temporary directory:
// a folder of that name made first by someone else (one other users may write, or a
// symlink) is refused with an error naming it, never built into and run from; a missing
// one is made private and reused.
func TestSharedBuildRefusesAFolderOthersControl(t *testing.T) {
	root := tinyModule(t)
	prefix := "onceflow-testbuild-" + randomHex(4) + "-"
	sum := sha256.Sum256([]byte(root + "\x00" + "." + "\x00" + "none"))
	dir := filepath.Join(os.TempDir(), prefix+hex.EncodeToString(sum[:8]))
	t.Cleanup(func() { _ = os.RemoveAll(dir) })

	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil { // as another user's folder would be
		t.Fatal(err)
	}
	if bin, err := buildShared(root, prefix, ".", "none"); err == nil || !strings.Contains(err.Error(), dir) {
		t.Fatalf("built %q into a folder anyone may write (%v), want an error naming it", bin, err)
	}

	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(t.TempDir(), dir); err != nil {
		t.Fatal(err)
	}
	if bin, err := buildShared(root, prefix, ".", "none"); err == nil {
		t.Fatalf("built %q through a symlink", bin)
	}

	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	bin, err := buildShared(root, prefix, ".", "none")
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("the build folder: %v %v, want a private folder", fi.Mode(), err)
	}
	if again, err := buildShared(root, prefix, ".", "none"); err != nil || again != bin {
		t.Fatalf("the second build: %q %v, want %q", again, err, bin)
	}
}
