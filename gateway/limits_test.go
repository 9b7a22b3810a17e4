package gateway_test

import (
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/gateway"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
)

// With the limiter on, the gateway keeps its callers, keyed or not, under the
// provider's requests per minute: the calls beyond it get the gateway's own 429 with
// Retry-After and retry-after-ms (so the SDKs wait that long), and the provider never
// answers 429. Without it, the same burst meets the provider's 429s.
func TestLimiterKeepsGatewayTrafficUnderTheProvidersLimit(t *testing.T) {
	t.Parallel()
	const rpm = 20
	for _, on := range []bool{true, false} {
		t.Run("limiter="+strconv.FormatBool(on), func(t *testing.T) {
			t.Parallel()
			fs, err := fakeserver.New(fakeserver.Config{RPM: rpm, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(fs.Close)
			var cfg gateway.Config
			if on {
				rdb, prefix := testenv.Redis(t)
				lim, err := limiter.New(rdb, limiter.Config{Prefix: prefix, Provider: "openai", Limits: limiter.Limits{RPM: rpm},
					MaxWait: 50 * time.Millisecond, Logger: testenv.Logger(t)})
				if err != nil {
					t.Fatal(err)
				}
				cfg.Limiter = lim
			}
			fl := gatewaysOn(t, fs, 2, cfg)
			var mu sync.Mutex
			codes := map[int]int{}
			var wg sync.WaitGroup
			for i := range 2 * rpm {
				wg.Go(func() {
					key := ""
					if i%2 == 0 {
						key = "limited-key-" + strconv.Itoa(i) + "-0000000"
					}
					r, b := post(t, fl.urls[i%2]+"/chat/completions", key, "Bearer sk-"+strconv.Itoa(i%3), chatBody)
					mu.Lock()
					defer mu.Unlock()
					codes[r.StatusCode]++
					if r.StatusCode == http.StatusTooManyRequests && on {
						eb, _ := llm.ParseErrorBody(b)
						ms, err := strconv.Atoi(r.Header.Get("retry-after-ms"))
						if eb.Code != "rate_limit_exceeded" || err != nil || ms <= 0 || r.Header.Get("Retry-After") == "" {
							t.Errorf("the limiter's 429: %v %s", r.Header, b)
						}
					}
				})
			}
			wg.Wait()
			st := fs.Stats()
			t.Logf("limiter %v: answers %v; upstream requests %d, by status %v", on, codes, st.Requests, st.ByStatus)
			if on {
				if st.ByStatus["429"] != 0 || codes[200] != rpm || codes[429] != rpm {
					t.Fatalf("with the limiter: upstream 429s %d, answers %v; want %d 200s, %d 429s from the gateway, none from the provider",
						st.ByStatus["429"], codes, rpm, rpm)
				}
				return
			}
			if st.ByStatus["429"] == 0 {
				t.Fatalf("without the limiter the burst met no provider 429 (%v): the test proves nothing", st.ByStatus)
			}
		})
	}
}
