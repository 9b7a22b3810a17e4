package redisstore

import (
	"os"
	"testing"

	"github.com/onceflow/onceflow/internal/testenv"
)

// TestMain starts a local Redis Cluster (3 primaries, on loopback) for the package's
// tests when ONCEFLOW_TEST_REDIS_CLUSTER is "local" (`make test` runs the package so a
// second time): newTestStore then builds every store on a cluster client of it, and the
// store's tests (the idempotency conformance suite among them) run on a cluster.
func TestMain(m *testing.M) { os.Exit(testenv.MainWithLocalCluster(m)) }
