package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/internal/webhooksink"
	"github.com/onceflow/onceflow/queue"
	"github.com/onceflow/onceflow/summaries"
)

// Issue 18's report, fixed: `onceflow run` pointed at a node of a Redis Cluster that does
// not hold the summaries queue's slot (ONCEFLOW_REDIS_CLUSTER_ADDRS naming that node
// alone) accepts a POST, runs the job and sends its email; /readyz is ready.
func TestRunOnARedisClusterFromANodeWithoutTheQueue(t *testing.T) {
	testenv.Long(t) // six Redis processes
	t.Parallel()
	c := testenv.PrivateRedisCluster(t, 3, 1)
	prefix := testenv.Prefix(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	probe := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	owner, err := probe.MasterForKey(ctx, queue.Keys{Prefix: prefix, Queue: summaries.QueueName}.Stream())
	if err != nil {
		t.Fatal(err)
	}
	seed := ""
	for _, a := range c.Addrs() {
		if a != owner.Options().Addr && seed == "" {
			seed = a
		}
	}
	_ = probe.Close()
	_, dsn := testenv.Postgres(t)
	sink := webhooksink.New(webhooksink.Options{})
	hook := httptest.NewServer(sink)
	t.Cleanup(hook.Close)
	p := testenv.Start(t, testenv.Binary(t), []string{
		"ONCEFLOW_REDIS_CLUSTER_ADDRS=" + seed, "ONCEFLOW_DATABASE_URL=" + dsn, "ONCEFLOW_PREFIX=" + prefix,
		"ONCEFLOW_API_KEYS=" + tenantAPIKeys, "ONCEFLOW_HTTP_ADDR=127.0.0.1:0", "ONCEFLOW_LLM=fake",
		"ONCEFLOW_SENDER=webhook", "ONCEFLOW_WEBHOOK_URL=" + hook.URL, "ONCEFLOW_RELAY_INTERVAL=50ms",
		"ONCEFLOW_SHUTDOWN_TIMEOUT=10s",
	}, "run")
	base := fmt.Sprintf("http://%v", p.WaitLog(ctx, "http listening")["addr"])
	r, err := postSummary(ctx, http.DefaultClient, base, testKeyAcme, "cluster-test-key-0001", summaryBody("Cluster review: the queue's slot is elsewhere."))
	if err != nil || r.code != http.StatusAccepted {
		t.Fatalf("POST through %s (the queue's slot is on %s): %v %d %s", seed, owner.Options().Addr, err, r.code, r.body)
	}
	var accepted struct {
		JobID string `json:"job_id"`
	}
	if err := json.Unmarshal(r.body, &accepted); err != nil || accepted.JobID == "" {
		t.Fatalf("POST body %s: %v", r.body, err)
	}
	testenv.WaitFor(t, 30*time.Second, "the email", func() bool { return sink.Count(summaries.DedupeKey(accepted.JobID)) == 1 })
	if code, body := httpGet(t, base+"/readyz", ""); code != http.StatusOK {
		t.Fatalf("/readyz %d %s", code, body)
	}
	if strings.Contains(p.Stderr(), "MOVED") {
		t.Fatalf("MOVED errors in the log: %.2000s", p.Stderr())
	}
}

// ONCEFLOW_REDIS_WAIT_REPLICAS reaches the accept: against a Redis without replicas a
// POST cannot be confirmed and answers 503 (the job is on the primary; a retry with the
// same key replays it once replicas confirm), and without the setting the same server
// accepts at once.
func TestServeWaitReplicasAnswers503WithoutReplicas(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	redisURL := testenv.RedisURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, base := startServe(t, "ONCEFLOW_REDIS_URL="+redisURL, "ONCEFLOW_DATABASE_URL="+dsn,
		"ONCEFLOW_REDIS_WAIT_REPLICAS=1", "ONCEFLOW_REDIS_WAIT_TIMEOUT=100ms")
	r, err := postSummary(ctx, http.DefaultClient, base, "test-key-acme-0123456789", "wait-replicas-key-0001", summaryBody("Replicas: none."))
	if err != nil {
		t.Fatal(err)
	}
	if r.code != http.StatusServiceUnavailable {
		t.Fatalf("POST with WAIT 1 and no replica: %d %s, want 503", r.code, r.body)
	}
	_, plain := startServe(t, "ONCEFLOW_REDIS_URL="+redisURL, "ONCEFLOW_DATABASE_URL="+dsn)
	if r, err := postSummary(ctx, http.DefaultClient, plain, "test-key-acme-0123456789", "wait-replicas-key-0002", summaryBody("Replicas: not asked.")); err != nil || r.code != http.StatusAccepted {
		t.Fatalf("POST without WAIT: %d %s %v", r.code, r.body, err)
	}
}
