// Package npmkit installs pinned npm packages for tests that drive real JavaScript
// clients under Node.js: the official OpenAI and Anthropic SDKs in front of onceflow
// gateway (gateway/sdk_test.go), for example.
//
// A test keeps a folder of testdata holding package.json (exact versions) and the
// package-lock.json that npm made from it, both committed; Install runs
// `npm ci --ignore-scripts` from them into a cache folder outside the repository, named
// by a digest of the two files, so the packages are downloaded once per machine and
// lockfile, never into the work tree. Installs are put in place by renaming a finished
// folder, so test binaries that install at once (go test runs packages in parallel)
// never see a half-installed folder; within one test binary they wait for each other.
//
// Node.js and npm must be on PATH: `scripts/dev-services up`, which `make test` runs,
// installs Debian's nodejs and npm when they are missing and it runs as root. A
// missing node or npm, or a failed install (no registry), fails the test, so CI cannot
// pass without running it; only ONCEFLOW_SKIP_NODE=1 skips such tests.
//
// To change a version: edit package.json, then in its folder run
//
//	npm install --package-lock-only --ignore-scripts --omit-lockfile-registry-resolved
//
// (the lockfile then names no registry: npm ci takes each package from the configured
// one and checks its integrity) and commit both files.
package npmkit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// Environment variables read by Install.
const (
	// EnvSkip, set to 1, makes Install skip the calling test instead of failing it when
	// Node.js tests cannot run here.
	EnvSkip = "ONCEFLOW_SKIP_NODE"
	// EnvCache names the folder that holds the installs. Default: onceflow-npm beside
	// the Go build cache (GOCACHE, else the user's cache folder).
	EnvCache = "ONCEFLOW_NPM_CACHE"
)

// InstallTimeout bounds one `npm ci`.
const InstallTimeout = 5 * time.Minute

// complete is the file that marks a finished install inside its folder.
const complete = ".onceflow-npmkit-complete"

// Modules is an installed set of npm packages.
type Modules struct {
	// Node is the path of the node executable.
	Node string
	// Dir is the install folder: package.json, package-lock.json and node_modules.
	Dir string
}

// NodeModules returns the node_modules folder of m.
func (m *Modules) NodeModules() string { return filepath.Join(m.Dir, "node_modules") }

var (
	mu       sync.Mutex // serialises installs within this process
	installs = map[string]*Modules{}
)

// Install installs the packages pinned by lockDir's package.json and package-lock.json
// (once per machine: later calls find the cached install) and returns them. It fails
// t when node or npm is missing or npm ci fails, and skips it when EnvSkip is 1. Safe
// for concurrent use, within a process and across processes.
func Install(t testing.TB, lockDir string) *Modules {
	t.Helper()
	if os.Getenv(EnvSkip) == "1" {
		t.Skipf("%s=1: not running the Node.js test", EnvSkip)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatalf("node not found on PATH: install Debian's nodejs and npm (scripts/dev-services up does so as root), or set %s=1 to skip the Node.js tests", EnvSkip)
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Fatalf("npm not found on PATH (node is %s): install Debian's npm (scripts/dev-services up does so as root), or set %s=1 to skip the Node.js tests", node, EnvSkip)
	}
	pkg, err := os.ReadFile(filepath.Join(lockDir, "package.json")) // #nosec G304 -- the test's own testdata
	if err != nil {
		t.Fatalf("npmkit: %v", err)
	}
	lock, err := os.ReadFile(filepath.Join(lockDir, "package-lock.json")) // #nosec G304 -- the test's own testdata
	if err != nil {
		t.Fatalf("npmkit: %v (make it with: npm install --package-lock-only --ignore-scripts --omit-lockfile-registry-resolved)", err)
	}
	sum := sha256.New()
	for _, b := range [][]byte{pkg, lock} {
		fmt.Fprintf(sum, "%d\n", len(b))
		sum.Write(b)
	}
	digest := hex.EncodeToString(sum.Sum(nil))[:24]

	mu.Lock()
	defer mu.Unlock()
	if m := installs[digest]; m != nil {
		return m
	}
	base, err := cacheBase()
	if err != nil {
		t.Fatalf("npmkit: %v", err)
	}
	final := filepath.Join(base, digest)
	if !finished(final) {
		start := time.Now()
		if err := install(base, final, npm, pkg, lock); err != nil {
			t.Fatalf("npmkit: installing %s: %v", lockDir, err)
		}
		t.Logf("npmkit: installed %s into %s in %v", lockDir, final, time.Since(start).Round(time.Millisecond))
	}
	m := &Modules{Node: node, Dir: final}
	installs[digest] = m
	return m
}

// cacheBase returns the folder holding the installs, created.
func cacheBase() (string, error) {
	base := os.Getenv(EnvCache)
	if base == "" {
		if gc := os.Getenv("GOCACHE"); gc != "" && gc != "off" && filepath.IsAbs(gc) {
			base = filepath.Join(filepath.Dir(gc), "onceflow-npm")
		} else if uc, err := os.UserCacheDir(); err == nil {
			base = filepath.Join(uc, "onceflow-npm")
		} else {
			base = filepath.Join(os.TempDir(), "onceflow-npm")
		}
	}
	// #nosec G703 -- the cache folder the developer configured (ONCEFLOW_NPM_CACHE, GOCACHE)
	if err := os.MkdirAll(base, 0o750); err != nil {
		return "", fmt.Errorf("cache folder: %w", err)
	}
	return base, nil
}

func finished(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, complete))
	return err == nil
}

// install runs npm ci in a fresh folder under base and renames it to final. Another
// process may win the rename: then its install is used and ours removed.
func install(base, final, npm string, pkg, lock []byte) error {
	removeStale(base)
	tmp, err := os.MkdirTemp(base, filepath.Base(final)+".tmp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp) // a no-op once renamed
	for name, b := range map[string][]byte{"package.json": pkg, "package-lock.json": lock} {
		if err := os.WriteFile(filepath.Join(tmp, name), b, 0o600); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), InstallTimeout)
	defer cancel()
	// --ignore-scripts: no package runs code at install time. --prefer-offline: npm's
	// own cache answers when it can, so a reinstall needs no registry.
	cmd := exec.CommandContext(ctx, npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline", "--loglevel=warn") // #nosec G204 -- npm from PATH, fixed arguments
	cmd.Dir = tmp
	cmd.Env = append(os.Environ(), "npm_config_update_notifier=false")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("npm ci: %w (is the npm registry reachable?)\n%s", err, tail(out.String(), 4000))
	}
	// A lockfile without packages makes no node_modules: make it, so that links to it
	// (Scripts) resolve.
	if err := os.MkdirAll(filepath.Join(tmp, "node_modules"), 0o750); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, complete), []byte(time.Now().UTC().Format(time.RFC3339)+"\n"), 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, final); err != nil {
		if finished(final) { // another process got there first
			return nil
		}
		if _, statErr := os.Stat(final); statErr == nil {
			// Not ours and not finished: left by a crash before this scheme; replace it.
			if rmErr := os.RemoveAll(final); rmErr != nil {
				return errors.Join(err, rmErr)
			}
			return os.Rename(tmp, final)
		}
		return err
	}
	return nil
}

// removeStale removes the temporary folders of installs that died over an hour ago.
func removeStale(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.Contains(e.Name(), ".tmp-") {
			continue
		}
		if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Hour {
			_ = os.RemoveAll(filepath.Join(base, e.Name()))
		}
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// Scripts copies the ES modules (.mjs files) of dir into a temporary folder of t beside
// a node_modules link to m's, and returns the folder: a script there imports the
// packages of m by their bare names ("openai"), which node resolves only from the
// script's own folder and those above it (ES modules ignore NODE_PATH).
func (m *Modules) Scripts(t testing.TB, dir string) string {
	t.Helper()
	folder := t.TempDir()
	if err := os.Symlink(m.NodeModules(), filepath.Join(folder, "node_modules")); err != nil {
		t.Fatalf("npmkit: %v", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("npmkit: %v", err)
	}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".mjs") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name())) // #nosec G304 -- the test's own testdata
		if err != nil {
			t.Fatalf("npmkit: %v", err)
		}
		// #nosec G703 -- a name read from the test's own testdata folder, into a temporary folder
		if err := os.WriteFile(filepath.Join(folder, e.Name()), b, 0o600); err != nil {
			t.Fatalf("npmkit: %v", err)
		}
	}
	return folder
}

// Command returns the command that runs script, the name of a file in folder (from
// Scripts), with m's node and args, from folder. Its Env is unset (the test's
// environment), its Stdout and Stderr are for the caller to set. Safe for concurrent
// use.
func (m *Modules) Command(ctx context.Context, folder, script string, args ...string) *exec.Cmd {
	// #nosec G204 -- node from PATH running the test's own script
	cmd := exec.CommandContext(ctx, m.Node, append([]string{filepath.Join(folder, script)}, args...)...)
	cmd.Dir = folder
	return cmd
}
