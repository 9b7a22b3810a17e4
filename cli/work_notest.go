//go:build !onceflowtest

package cli

import (
	"errors"
	"flag"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/queue"
)

// A production build has no test aids: `onceflow work` has no --test-handler, so the
// flag is unknown (a usage error, exit 2). The tests' binary is built with -tags
// onceflowtest and gets work_testhandler.go instead of this file.

// testHandlerUsage is the --test-handler part of `onceflow work`'s usage line: none.
const testHandlerUsage = ""

// testHandlerFlag registers nothing; the returned SPEC is always "".
func testHandlerFlag(*flag.FlagSet) *string { return new(string) }

// newTestHandler is never called: the SPEC is always "".
func newTestHandler(string, redis.UniversalClient, queue.Keys) (queue.Handler, error) {
	return nil, errors.New("this build has no test handlers")
}
