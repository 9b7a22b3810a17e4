package config

import (
	"errors"
	"slices"
	"testing"
)

func TestRedisClusterAddrs(t *testing.T) {
	c, err := load(t, nil)
	if err != nil || c.RedisClusterAddrs != nil || c.RedisClusterURL() != "" {
		t.Fatalf("default: %v %q %v", c.RedisClusterAddrs, c.RedisClusterURL(), err)
	}
	c, err = load(t, map[string]string{"ONCEFLOW_REDIS_CLUSTER_ADDRS": "10.0.0.1:7000, 10.0.0.2:7001,10.0.0.1:7000",
		"ONCEFLOW_REDIS_URL": "rediss://app:s3cret@ignored:6379/2?dial_timeout=3s"})
	if err != nil || !slices.Equal(c.RedisClusterAddrs, []string{"10.0.0.1:7000", "10.0.0.2:7001"}) {
		t.Fatalf("%v %v", c.RedisClusterAddrs, err)
	}
	// The seeds with the URL's scheme (TLS), user, password and options; no host, no db.
	if got, want := c.RedisClusterURL(), "rediss://app:s3cret@10.0.0.1:7000?addr=10.0.0.2%3A7001&dial_timeout=3s"; got != want {
		t.Fatalf("cluster URL %q, want %q", got, want)
	}
	for _, bad := range []string{"10.0.0.1", "10.0.0.1:0", ":7000", "host:port", "10.0.0.1:7000,"} {
		_, err := load(t, map[string]string{"ONCEFLOW_REDIS_CLUSTER_ADDRS": bad})
		var ce *Error
		if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_REDIS_CLUSTER_ADDRS" {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
