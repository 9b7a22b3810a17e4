package cli

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is set at build time with -ldflags "-X github.com/onceflow/onceflow/cli.version=..." (the Makefile does).
var version = "dev"

// buildInfo returns the version, the VCS revision the binary was built from (with
// "+dirty" when the tree had changes) and the Go version.
func buildInfo() (ver, revision, goVersion string) {
	ver, revision, goVersion = version, "unknown", runtime.Version()
	if bi, ok := debug.ReadBuildInfo(); ok {
		var dirty bool
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if dirty {
			revision += "+dirty"
		}
	}
	return ver, revision, goVersion
}

func runVersion(_ context.Context, e *env, args []string) error {
	fs := flags(e, "version", "")
	if err := parse(fs, args); err != nil {
		return err
	}
	v, rev, gov := buildInfo()
	fmt.Fprintf(e.stdout, "onceflow %s (revision %s, %s)\n", v, rev, gov)
	return nil
}
