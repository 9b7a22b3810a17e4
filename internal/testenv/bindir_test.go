package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

func TestBinDirRemovesTheDirectoriesOfExitedProcesses(t *testing.T) {
	prefix := "onceflow-bindir-test-"
	// A process that has exited: its id names a directory left behind.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := filepath.Join(os.TempDir(), prefix+strconv.Itoa(cmd.Process.Pid)+"-x")
	if err := os.MkdirAll(filepath.Join(dead, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	// A process that runs (this one's parent) keeps its directory; so does a name
	// without a process id.
	alive := filepath.Join(os.TempDir(), prefix+strconv.Itoa(os.Getppid())+"-y")
	other := filepath.Join(os.TempDir(), prefix+"notapid")
	for _, d := range []string{alive, other} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, d := range []string{dead, alive, other} {
			_ = os.RemoveAll(d)
		}
	})

	own, err := BinDir(prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(own) })

	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("the directory of an exited process is still there (stat: %v)", err)
	}
	for _, d := range []string{alive, other, own} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("%s was removed: %v", d, err)
		}
	}
	if want := prefix + strconv.Itoa(os.Getpid()) + "-"; filepath.Base(own)[:len(want)] != want {
		t.Errorf("BinDir made %s, want a name starting %s", own, want)
	}
}
