package config_test

import (
	"strings"
	"testing"

	"github.com/onceflow/onceflow/config"
)

// Guard (second attack round of issue 18): RedactURL hides both secrets of a Sentinel URL: the sentinels' password (the
// userinfo) and the primary's (the password parameter), and keeps master_name and addr.
func TestAttack18bRedactSentinelURL(t *testing.T) {
	u := "redis://admin:sentPW1@s1:26379?addr=s2:26379&master_name=mymaster&username=app&password=primPW2"
	got := config.RedactURL(u)
	if strings.Contains(got, "sentPW1") || strings.Contains(got, "primPW2") {
		t.Fatalf("RedactURL(%s) = %s", u, got)
	}
	if !strings.Contains(got, "master_name=mymaster") || !strings.Contains(got, "s2%3A26379") && !strings.Contains(got, "s2:26379") {
		t.Fatalf("RedactURL lost the sentinel settings: %s", got)
	}
}
