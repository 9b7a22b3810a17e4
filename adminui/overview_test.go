package adminui_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/adminui"
	"github.com/onceflow/onceflow/adminui/adminuitest"
	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/limiter"
	"github.com/onceflow/onceflow/llm/fake"
)

// With a model and its limiter, the overview shows each model's limits, what its
// buckets hold and its pause.
func TestOverviewShowsTheLimiter(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	c, err := onceflow.NewClient(onceflow.Config{Redis: rdb, DB: db, Prefix: prefix, Logger: testenv.Logger(t), Model: fake.New(), Provider: "openai",
		Limits: limiter.Config{Models: map[string]limiter.Limits{"gpt-4.1-mini": {RPM: 600, TPM: 200000, Concurrency: 8}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(context.Background(), c.Inspector().Limiter().Keys().Model("openai/gpt-4.1-mini"), "pause", time.Now().Add(time.Minute).UnixMilli(), "why", "429 from the provider").Err(); err != nil {
		t.Fatal(err)
	}
	e := adminuitest.Serve(t, c, rdb, adminui.Config{})
	b := adminuitest.Browser(t)
	if code := adminuitest.SignIn(t, e, b, adminuitest.AdminKey); code != http.StatusSeeOther {
		t.Fatal(code)
	}
	_, page := adminuitest.Get(t, b, e.URL+"/ui/")
	for _, want := range []string{`<th scope="row">gpt-4.1-mini</th>`, "/ 600", "/ 200000", "0 / 8", "429 from the provider"} {
		if !strings.Contains(page, want) {
			t.Fatalf("the overview lacks %q: %.6000s", want, page)
		}
	}
}
