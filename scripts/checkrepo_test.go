package scripts

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckRepoRefusesBigFilesAndBinaries runs scripts/check-repo in a repository of its
// own: clean, it passes; a tracked file over 1 MiB or a tracked executable binary (ELF,
// Mach-O, PE, WebAssembly) makes it fail naming the file, whatever its mode, while
// executable scripts, big untracked files and binary data that is not a program pass.
func TestCheckRepoRefusesBigFilesAndBinaries(t *testing.T) {
	t.Parallel()
	script, err := filepath.Abs("check-repo")
	if err != nil {
		t.Fatal(err)
	}
	repo := t.TempDir()
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@example.com"}, args...)...)
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	write := func(name string, data []byte, mode os.FileMode) {
		t.Helper()
		p := filepath.Join(repo, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, mode); err != nil {
			t.Fatal(err)
		}
	}
	check := func() (string, int) {
		t.Helper()
		cmd := exec.Command(script)
		cmd.Dir = repo
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			return string(out), ee.ExitCode()
		} else if err != nil {
			t.Fatalf("check-repo: %v", err)
		}
		return string(out), 0
	}
	git("init", "-q")
	write("README.md", []byte("# a project\n"), 0o644)
	write("scripts/run", []byte("#!/usr/bin/env bash\necho hi\n"), 0o755)
	write("testdata/image.png", append([]byte("\x89PNG\r\n\x1a\n"), make([]byte, 4096)...), 0o644)
	write("testdata/exactly-1MiB.txt", []byte(strings.Repeat("a", 1<<20)), 0o644)
	write("untracked-build", append([]byte("\x7fELF\x02\x01\x01"), make([]byte, 2<<20)...), 0o755)
	git("add", "README.md", "scripts/run", "testdata")
	git("commit", "-q", "-m", "clean")
	if out, code := check(); code != 0 {
		t.Fatalf("a clean repository: exit %d\n%s", code, out)
	}

	bad := map[string][]byte{
		"big.json":         []byte(strings.Repeat("b", 1<<20+1)),
		"bin/tool":         append([]byte("\x7fELF\x02\x01\x01"), make([]byte, 1024)...),
		"macho":            append([]byte{0xcf, 0xfa, 0xed, 0xfe}, make([]byte, 64)...),
		"fat-macho":        append([]byte{0xca, 0xfe, 0xba, 0xbe}, make([]byte, 64)...),
		"tool.exe":         append(append([]byte("MZ"), make([]byte, 0x3a)...), 0x40, 0, 0, 0, 'P', 'E', 0, 0),
		"module.wasm":      append([]byte("\x00asm\x01\x00\x00\x00"), make([]byte, 16)...),
		"not/executable.o": append([]byte("\x7fELF\x01\x01\x01"), make([]byte, 64)...),
	}
	for name, data := range bad {
		write(name, data, 0o644)
		if name == "bin/tool" {
			_ = os.Chmod(filepath.Join(repo, name), 0o755)
		}
		git("add", name)
	}
	git("commit", "-q", "-m", "bad")
	out, code := check()
	if code != 1 {
		t.Fatalf("exit %d, want 1\n%s", code, out)
	}
	for name := range bad {
		if !strings.Contains(out, name) {
			t.Errorf("the output does not name %s:\n%s", name, out)
		}
	}
	for _, fine := range []string{"README.md", "scripts/run", "image.png", "exactly-1MiB.txt", "untracked-build"} {
		if strings.Contains(out, fine) {
			t.Errorf("the output names %s, which is fine:\n%s", fine, out)
		}
	}

	git("rm", "-q", "--cached", "big.json", "bin/tool", "macho", "fat-macho", "tool.exe", "module.wasm", "not/executable.o")
	if out, code := check(); code != 0 {
		t.Fatalf("after git rm --cached (the files stay on disk, untracked): exit %d\n%s", code, out)
	}
}

// The repository itself passes the check (CI runs it through make lint).
func TestRepositoryPassesCheckRepo(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("./check-repo")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("scripts/check-repo: %v\n%s", err, out)
	}
}
