package npmkit

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// The lockfile of testdata/empty pins no package, so npm ci needs no registry: these
// tests run offline.

func TestInstallOnceThenRunScripts(t *testing.T) {
	cache := t.TempDir()
	t.Setenv(EnvCache, cache)
	m := Install(t, "testdata/empty")
	if filepath.Dir(m.Dir) != cache {
		t.Fatalf("installed into %s, want a folder of %s", m.Dir, cache)
	}
	for _, f := range []string{"package.json", "package-lock.json", complete} {
		if _, err := os.Stat(filepath.Join(m.Dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	if again := Install(t, "testdata/empty"); again != m {
		t.Fatalf("a second Install in one process installed again: %+v, %+v", m, again)
	}
	// Another process finds the finished install and does not run npm again.
	installs = map[string]*Modules{}
	stamp, _ := os.ReadFile(filepath.Join(m.Dir, complete))
	if other := Install(t, "testdata/empty"); other.Dir != m.Dir {
		t.Fatalf("another process installed into %s, not the cached %s", other.Dir, m.Dir)
	}
	if now, _ := os.ReadFile(filepath.Join(m.Dir, complete)); string(now) != string(stamp) {
		t.Fatal("the cached install was redone")
	}

	folder := m.Scripts(t, "testdata/empty")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := m.Command(ctx, folder, "hello.mjs", "npmkit").Output()
	if err != nil {
		t.Fatalf("node hello.mjs: %v", err)
	}
	var got struct {
		Greeting    string
		NodeModules bool
	}
	if err := json.Unmarshal(out, &got); err != nil || got.Greeting != "hello npmkit" || !got.NodeModules {
		t.Fatalf("hello.mjs printed %s (%v)", out, err)
	}
}

// Test binaries that install at once: each npm ci runs in a folder of its own, one
// rename wins, and every one ends with the finished install.
func TestConcurrentInstallsRenameIntoPlace(t *testing.T) {
	t.Setenv(EnvCache, t.TempDir())
	Install(t, "testdata/empty") // node and npm present, or skip or fail as Install does
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Fatal(err)
	}
	pkg, _ := os.ReadFile("testdata/empty/package.json")
	lock, _ := os.ReadFile("testdata/empty/package-lock.json")
	base := t.TempDir()
	final := filepath.Join(base, "digest")
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = install(base, final, npm, pkg, lock)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if !finished(final) {
		t.Fatal("no finished install")
	}
	entries, _ := os.ReadDir(base)
	if len(entries) != 1 {
		names := []string{}
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("left in the cache folder: %v; want the install only", names)
	}
}

func TestSkipWhenAsked(t *testing.T) {
	ran := false
	t.Run("skipped", func(t *testing.T) {
		t.Setenv(EnvSkip, "1")
		Install(t, "testdata/does-not-exist")
		ran = true
	})
	if ran {
		t.Fatalf("Install with %s=1 did not skip", EnvSkip)
	}
}
