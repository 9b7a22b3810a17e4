package cli

// Attacks on issue 16's third pass, as a new user following docs/providers.md with the
// real binary. Each test states what must hold and whether it failed on the commit it
// was written against (76bc248).

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/internal/testenv"
)

// A new user who starts `onceflow gateway` on a database that `onceflow migrate` never
// ran on (docs/providers.md: "It needs PostgreSQL (ONCEFLOW_DATABASE_URL, migrated by
// onceflow migrate)"): the gateway must say so where an operator looks: a /readyz that
// is not 200 and names the migration, so that a load balancer sends it nothing. Every
// keyed request fails on it, with nothing any retry can mend.
//
// Fails on 76bc248: the gateway starts, /readyz answers 200 (it only pings), and every
// keyed request gets 503 ledger_unavailable with Retry-After: 1 and retry-after-ms:
// 1000, "retry later", which the SDKs retry and then report as an outage; only the log
// says `relation "llm_calls" does not exist`.
func TestAttack16cGatewayOnAnUnmigratedDatabaseIsNotReady(t *testing.T) {
	t.Parallel()
	dsn := testenv.EmptySchema(t)
	_, fake := startFakeLLM(t)
	_, v1 := startGateway(t, dsn, fake, "ONCEFLOW_SHUTDOWN_TIMEOUT=5s")
	base := strings.TrimSuffix(v1, "/v1")
	status, body := 0, ""
	for range 20 { // /readyz may take a moment to notice
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		status, body = resp.StatusCode, string(b)
		if status != http.StatusOK {
			if !strings.Contains(body, "onceflow migrate") {
				t.Fatalf("/readyz answers %d %s: it should name `onceflow migrate`", status, body)
			}
			return // holds
		}
		time.Sleep(100 * time.Millisecond)
	}
	code, answer, err := keyedPost(v1, "unmigrated-key-0001")
	t.Fatalf("on an unmigrated database the gateway started and /readyz answers %d %s; a keyed request gets %d %s (%v): "+
		"a missing schema looks like a passing outage, retried by every SDK", status, body, code, answer, err)
}
