package browsertest_test

import (
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/chromedp/chromedp"

	"github.com/onceflow/onceflow/lab/browsertest"
)

// New starts a headless Chromium that loads a local page at the window size, and
// Screenshot saves that Width×Height viewport as a PNG.
func TestNewLoadsAPageAndScreenshots(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write([]byte(`<!doctype html><title>hello</title><p id="p">hello, browser</p>`))
	}))
	defer srv.Close()
	ctx := browsertest.New(t)
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL), chromedp.WaitVisible(chromedp.ID("p"))); err != nil {
		t.Fatal(err)
	}
	text, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID("p")))
	if err != nil || text != "hello, browser" {
		t.Fatalf("text %q, %v", text, err)
	}
	size, err := chromedp.Run(ctx, chromedp.Evaluate[[]int](`[window.innerWidth, window.innerHeight]`))
	if err != nil || len(size) != 2 || size[0] != browsertest.Width || size[1] != browsertest.Height {
		t.Fatalf("viewport %v, %v", size, err)
	}
	path := filepath.Join(t.TempDir(), "shots", "page.png")
	if err := browsertest.Screenshot(ctx, path); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cfg, err := png.DecodeConfig(f)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Width != size[0] || cfg.Height != size[1] {
		t.Fatalf("screenshot %dx%d, viewport %v", cfg.Width, cfg.Height, size)
	}
}

// Without the browser, New skips the test (the knob ONCEFLOW_BROWSER points it at a
// path that does not exist).
func TestNewSkipsWithoutTheBrowser(t *testing.T) {
	t.Setenv(browsertest.EnvExecPath, filepath.Join(t.TempDir(), "no-chromium"))
	t.Setenv(browsertest.EnvRequire, "")
	skipped := false
	// New runs in a subtest, whose skip is what this looks at.
	t.Run("inner", func(t *testing.T) {
		defer func() { skipped = t.Skipped() }()
		browsertest.New(t)
		t.Error("New returned without the browser")
	})
	if !skipped {
		t.Fatal("New did not skip without the browser")
	}
}
