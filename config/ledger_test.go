package config

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestLedgerAndGatewaySettings(t *testing.T) {
	c, err := load(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.LedgerRetention != 24*time.Hour || c.LedgerRelaxedInsert || c.GatewayTimeout != 5*time.Minute || c.GatewayMaxBody != 8<<20 {
		t.Fatalf("defaults: retention %v relaxed %v gateway timeout %v max body %d", c.LedgerRetention, c.LedgerRelaxedInsert, c.GatewayTimeout, c.GatewayMaxBody)
	}
	c, err = load(t, map[string]string{"ONCEFLOW_LEDGER_RELAXED_INSERT": "true", "ONCEFLOW_LEDGER_RETENTION": "72h"})
	if err != nil || !c.LedgerRelaxedInsert || c.LedgerRetention != 72*time.Hour {
		t.Fatalf("%+v %v", c, err)
	}
	if _, err := load(t, map[string]string{"ONCEFLOW_LEDGER_RELAXED_INSERT": "maybe"}); err == nil {
		t.Fatal("a non-boolean accepted")
	}
	// The retention must cover the retry horizon: 5 × (max(2m, 5m) + 60s) = 30m by default.
	_, err = load(t, map[string]string{"ONCEFLOW_LEDGER_RETENTION": "10m"})
	var ce *Error
	if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_LEDGER_RETENTION" || !strings.Contains(err.Error(), "30m0s") {
		t.Fatalf("retention below the retry horizon: %v", err)
	}
	if _, err := load(t, map[string]string{"ONCEFLOW_LEDGER_RETENTION": "30m"}); err != nil {
		t.Fatalf("retention equal to the horizon: %v", err)
	}
}
