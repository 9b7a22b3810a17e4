// Package browsertest starts a headless Chromium for tests that drive onceflow's pages
// in a real browser (the operator UI's, adminui/browser_test.go), through chromedp.
//
// New gives a test a browser tab of its own, in a browser process of its own with a
// fresh profile, and ends it when the test ends. Where Chromium is not installed
// (scripts/install-chromium installs Debian's), New skips the test, unless
// ONCEFLOW_REQUIRE_BROWSER=1 says the browser must be there (then the test fails).
// Screenshot saves what the tab shows as a PNG.
//
// The browser is started with the flags a machine with no network beyond loopback
// needs: without --disable-background-networking and its kin, Chromium keeps trying
// to reach Google's hosts.
package browsertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// Where the browser is and what the tests need of it.
const (
	// DefaultExecPath is Debian's Chromium, which scripts/install-chromium installs.
	DefaultExecPath = "/usr/bin/chromium"
	// EnvExecPath names another browser binary instead of DefaultExecPath (a path
	// that does not exist makes New skip, which is how to try the skip).
	EnvExecPath = "ONCEFLOW_BROWSER"
	// EnvRequire, set to 1, makes New fail the test instead of skipping it when the
	// browser is missing (for a CI that installed it).
	EnvRequire = "ONCEFLOW_REQUIRE_BROWSER"
	// Width and Height are the size of the page in the browser, hence the
	// screenshots'.
	Width, Height = 1280, 800
	// Timeout bounds a test's whole use of the browser: the context New returns
	// ends after it.
	Timeout = 30 * time.Second
)

// ExecPath returns the browser binary New starts: $ONCEFLOW_BROWSER, else
// DefaultExecPath.
func ExecPath() string {
	if p := os.Getenv(EnvExecPath); p != "" {
		return p
	}
	return DefaultExecPath
}

// Available reports whether the browser binary New starts exists and is executable.
func Available() bool {
	fi, err := os.Stat(ExecPath())
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// New starts a headless Chromium (ExecPath) with a fresh profile in t.TempDir() and a
// Width×Height viewport, and returns the context of its first tab, for chromedp.Run
// and chromedp.Do. The context ends after Timeout; the browser is stopped when the
// test ends. Without the browser, New skips the test (fails it when
// ONCEFLOW_REQUIRE_BROWSER=1).
func New(t testing.TB) context.Context {
	t.Helper()
	path := ExecPath()
	if !Available() {
		msg := fmt.Sprintf("browsertest: no browser at %s (install it with scripts/install-chromium, or set %s)", path, EnvExecPath)
		if os.Getenv(EnvRequire) == "1" {
			t.Fatal(msg + "; " + EnvRequire + "=1 requires it")
		}
		t.Skip(msg + ": skipping the browser test")
	}
	out := &lockedWriter{b: &strings.Builder{}}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(path),
		chromedp.Flag("headless", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("mute-audio", true),
		chromedp.NoSandbox,
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-breakpad", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-features", "Translate,OptimizationHints,MediaRouter"),
		chromedp.Flag("metrics-recording-only", true),
		chromedp.Flag("password-store", "basic"),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(Width, Height),
		chromedp.CombinedOutput(out),
	)
	ctx, cancelTab := chromedp.NewContext(actx, chromedp.WithErrorf(func(format string, args ...any) {
		// chromedp reports protocol messages it cannot decode here; they do not
		// fail a test, but they help to read one that failed.
		t.Logf("chromedp: "+format, args...)
	}))
	// Start the browser now, under a context without the deadline: the first Run on
	// a context owns the browser process. The window's size leaves less to the page
	// (headless Chromium keeps room for a window's frame and toolbar), so the page
	// gets exactly Width×Height.
	if err := chromedp.Do(ctx, chromedp.EmulateViewport(Width, Height)); err != nil {
		cancelTab()
		cancelAlloc()
		t.Fatalf("browsertest: start %s: %v\n%s", path, err, out.String())
	}
	tctx, cancelTimeout := context.WithTimeout(ctx, Timeout)
	t.Cleanup(func() {
		cancelTimeout()
		cancelTab()
		cancelAlloc()
		if s := quiet(out.String()); t.Failed() && s != "" {
			t.Logf("browser output:\n%s", tail(s, 4000))
		}
	})
	return tctx
}

// Screenshot saves what the tab of ctx shows (its Width×Height viewport) as a PNG at
// path, making path's directory if needed.
func Screenshot(ctx context.Context, path string) error {
	png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	if err != nil {
		return fmt.Errorf("browsertest: screenshot: %w", err)
	}
	if len(png) == 0 {
		return errors.New("browsertest: screenshot: the browser returned no image")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return fmt.Errorf("browsertest: screenshot: %w", err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil { // #nosec G306 -- a picture for the docs, meant to be read
		return fmt.Errorf("browsertest: screenshot: %w", err)
	}
	return nil
}

// lockedWriter collects the browser's output, which chromedp copies from another
// goroutine.
type lockedWriter struct {
	mu sync.Mutex
	b  *strings.Builder
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *lockedWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// quiet drops the browser's complaints that it has no D-Bus, which it makes on every
// machine without a desktop.
func quiet(s string) string {
	var keep []string
	for _, line := range strings.Split(s, "\n") {
		if line != "" && !strings.Contains(line, ":ERROR:dbus/") {
			keep = append(keep, line)
		}
	}
	return strings.Join(keep, "\n")
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}
