package config

import (
	"errors"
	"flag"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// load runs a Loader over args and an environment given as a map.
func load(t *testing.T, env map[string]string, args ...string) (*Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	l := Register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse flags: %v", err)
	}
	return l.Load(func(k string) string { return env[k] })
}

func TestDefaultsMatchContract(t *testing.T) {
	t.Parallel()
	c, err := load(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"RedisURL", c.RedisURL, "redis://127.0.0.1:6379/0"},
		{"DatabaseURL", c.DatabaseURL, "postgres://onceflow@127.0.0.1:5432/onceflow?sslmode=disable"},
		{"Prefix", c.Prefix, "onceflow"},
		{"HTTPAddr", c.HTTPAddr, "127.0.0.1:8080"},
		{"HTTPReadHeaderTimeout", c.HTTPReadHeaderTimeout, 10 * time.Second},
		{"HTTPReadTimeout", c.HTTPReadTimeout, 30 * time.Second},
		{"HTTPIdleTimeout", c.HTTPIdleTimeout, 2 * time.Minute},
		{"HTTPMaxHeaderBytes", c.HTTPMaxHeaderBytes, 65536},
		{"LLM", c.LLM, "fake"},
		{"LLMModel", c.LLMModel, "gpt-4.1-mini"},
		{"Sender", c.Sender, "log"},
		{"WorkerConcurrency", c.WorkerConcurrency, 64},
		{"ClaimIdle", c.ClaimIdle, 2 * time.Minute},
		{"MaxDeliveries", c.MaxDeliveries, 5},
		{"LockTTL", c.LockTTL, 30 * time.Second},
		{"ResultTTL", c.ResultTTL, 24 * time.Hour},
		{"DLQRetention", c.DLQRetention, 30 * 24 * time.Hour},
		{"IdempotencyTimeout", c.IdempotencyTimeout, 500 * time.Millisecond},
		{"IdempotencyResponseLimit", c.IdempotencyResponseLimit, 65536},
		{"JobBudget", c.JobBudget, 60 * time.Second},
		{"LLMTimeout", c.LLMTimeout, 20 * time.Second},
		{"LedgerLease", c.LedgerLease, 15 * time.Second},
		{"RelayInterval", c.RelayInterval, 250 * time.Millisecond},
		{"RelayLease", c.RelayLease, 30 * time.Second},
		{"RelayMaxAttempts", c.RelayMaxAttempts, 10},
		{"RelayBatchSize", c.RelayBatchSize, 100},
		{"RelayConcurrency", c.RelayConcurrency, 16},
		{"OutboxRetention", c.OutboxRetention, 7 * 24 * time.Hour},
		{"ShutdownTimeout", c.ShutdownTimeout, 30 * time.Second},
		{"MetricsAddr", c.MetricsAddr, ""},
		{"GatewayAddr", c.GatewayAddr, "127.0.0.1:8090"},
		{"AuditMaxAge", c.AuditMaxAge, 10 * time.Minute},
		{"LogFormat", c.LogFormat, "json"},
		{"APIKeys", len(c.APIKeys), 0},
		{"GatewayCredentialHeaders", len(c.GatewayCredentialHeaders), 0},
		{"RedisWaitReplicas", c.RedisWaitReplicas, 0},
		{"RedisWaitTimeout", c.RedisWaitTimeout, 250 * time.Millisecond},
		{"SummariesLane", c.SummariesLane, "sync"},
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s = %v, want %v", ch.name, ch.got, ch.want)
		}
	}
}

func TestPrecedenceFlagOverEnvOverDefault(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_CLAIM_IDLE": "5m", "ONCEFLOW_MAX_DELIVERIES": "7"}, "--claim-idle", "90s")
	if err != nil {
		t.Fatal(err)
	}
	if c.ClaimIdle != 90*time.Second {
		t.Errorf("ClaimIdle = %v, want the flag's 90s", c.ClaimIdle)
	}
	if c.MaxDeliveries != 7 {
		t.Errorf("MaxDeliveries = %d, want the variable's 7", c.MaxDeliveries)
	}
	if c.LockTTL != 30*time.Second {
		t.Errorf("LockTTL = %v, want the default 30s", c.LockTTL)
	}
}

func TestInvalidValuesNameTheirSource(t *testing.T) {
	t.Parallel()
	cases := []struct {
		env     map[string]string
		args    []string
		wantMsg string
	}{
		{map[string]string{"ONCEFLOW_CLAIM_IDLE": "abc"}, nil, `invalid ONCEFLOW_CLAIM_IDLE="abc": time: invalid duration "abc"`},
		{nil, []string{"--claim-idle", "abc"}, `invalid --claim-idle="abc"`},
		{map[string]string{"ONCEFLOW_CLAIM_IDLE": "-1s"}, nil, `invalid ONCEFLOW_CLAIM_IDLE="-1s": must be positive`},
		{map[string]string{"ONCEFLOW_DLQ_RETENTION": "-1h"}, nil, `invalid ONCEFLOW_DLQ_RETENTION="-1h": must not be negative`},
		{map[string]string{"ONCEFLOW_WORKER_CONCURRENCY": "0"}, nil, `invalid ONCEFLOW_WORKER_CONCURRENCY="0": must be between 1 and 100000`},
		{map[string]string{"ONCEFLOW_MAX_DELIVERIES": "five"}, nil, `invalid ONCEFLOW_MAX_DELIVERIES="five": not an integer`},
		{map[string]string{"ONCEFLOW_LLM": "gemini"}, nil, `invalid ONCEFLOW_LLM="gemini": want one of openai, anthropic, fake`},
		{map[string]string{"ONCEFLOW_SENDER": "pigeon"}, nil, `invalid ONCEFLOW_SENDER="pigeon"`},
		{map[string]string{"ONCEFLOW_LOG_FORMAT": "xml"}, nil, `invalid ONCEFLOW_LOG_FORMAT="xml"`},
		{map[string]string{"ONCEFLOW_REDIS_URL": "http://x"}, nil, `invalid ONCEFLOW_REDIS_URL="http://x": scheme must be one of redis, rediss, unix`},
		{map[string]string{"ONCEFLOW_DATABASE_URL": "mysql://x/db"}, nil, `invalid ONCEFLOW_DATABASE_URL`},
		{map[string]string{"ONCEFLOW_HTTP_ADDR": "8080"}, nil, `invalid ONCEFLOW_HTTP_ADDR="8080"`},
		{map[string]string{"ONCEFLOW_HTTP_ADDR": "127.0.0.1:99999"}, nil, `invalid ONCEFLOW_HTTP_ADDR="127.0.0.1:99999": invalid port`},
		{map[string]string{"ONCEFLOW_HTTP_READ_TIMEOUT": "0s"}, nil, `invalid ONCEFLOW_HTTP_READ_TIMEOUT="0s": must be positive`},
		{map[string]string{"ONCEFLOW_HTTP_READ_HEADER_TIMEOUT": "soon"}, nil, `invalid ONCEFLOW_HTTP_READ_HEADER_TIMEOUT="soon"`},
		{map[string]string{"ONCEFLOW_HTTP_IDLE_TIMEOUT": "-1m"}, nil, `invalid ONCEFLOW_HTTP_IDLE_TIMEOUT="-1m": must be positive`},
		{map[string]string{"ONCEFLOW_HTTP_MAX_HEADER_BYTES": "1024"}, nil, `invalid ONCEFLOW_HTTP_MAX_HEADER_BYTES="1024": must be between 4096 and 16777216`},
		{map[string]string{"ONCEFLOW_PREFIX": "a:b"}, nil, `invalid ONCEFLOW_PREFIX="a:b"`},
		{map[string]string{"ONCEFLOW_PREFIX": "{a}"}, nil, `invalid ONCEFLOW_PREFIX="{a}"`},
		{map[string]string{"ONCEFLOW_SENDER": "webhook"}, nil, `invalid ONCEFLOW_WEBHOOK_URL="": required when ONCEFLOW_SENDER=webhook`},
		{map[string]string{"ONCEFLOW_SENDER": "smtp", "ONCEFLOW_SMTP_URL": "smtp://h:25"}, nil, `invalid ONCEFLOW_SMTP_FROM="": required`},
		{map[string]string{"ONCEFLOW_SMTP_FROM": "not an address"}, nil, `invalid ONCEFLOW_SMTP_FROM`},
		{map[string]string{"ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS": "X-Key,bad header"}, nil, `invalid ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS="X-Key,bad header": name 2: "bad header" is not a valid HTTP header name`},
		{map[string]string{"ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS": "X-Key,"}, nil, `name 2: "" is not a valid HTTP header name`},
		{map[string]string{"ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS": "X-Key:"}, nil, `name 1: "X-Key:" is not a valid HTTP header name`},
		{map[string]string{"ONCEFLOW_API_KEYS": "acme"}, nil, `pair 1: want TENANT:KEY`},
		{map[string]string{"ONCEFLOW_API_KEYS": "acme:short"}, nil, `key must be at least 16 printable characters`},
		{map[string]string{"ONCEFLOW_API_KEYS": "ac me:0123456789abcdef"}, nil, `tenant must be`},
		{map[string]string{"ONCEFLOW_API_KEYS": "a:0123456789abcdef,b:0123456789abcdef"}, nil, `the same key is given to tenants a and b`},
	}
	for _, tc := range cases {
		t.Run(tc.wantMsg, func(t *testing.T) {
			_, err := load(t, tc.env, tc.args...)
			if err == nil {
				t.Fatal("no error")
			}
			var ce *Error
			if !errors.As(err, &ce) {
				t.Fatalf("error %v is not a *config.Error", err)
			}
			if !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("error %q does not contain %q", err, tc.wantMsg)
			}
		})
	}
}

// ONCEFLOW_DLQ_RETENTION=0 keeps dead letters for ever.
func TestDLQRetentionZeroMeansForEver(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_DLQ_RETENTION": "0"})
	if err != nil || c.DLQRetention != 0 {
		t.Fatalf("ONCEFLOW_DLQ_RETENTION=0: %v %v, want 0", c, err)
	}
}

func TestEmptyVariableMeansDefault(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_CLAIM_IDLE": ""})
	if err != nil {
		t.Fatal(err)
	}
	if c.ClaimIdle != 2*time.Minute {
		t.Fatalf("ClaimIdle = %v, want default", c.ClaimIdle)
	}
}

func TestGatewayCredentialHeadersAreAList(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_GATEWAY_CREDENTIAL_HEADERS": "X-Custom-Key, x-tenant-token"})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(c.GatewayCredentialHeaders, "|"); got != "X-Custom-Key|x-tenant-token" {
		t.Fatalf("GatewayCredentialHeaders = %q", c.GatewayCredentialHeaders)
	}
}

func TestAPIKeysGiveTenants(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_API_KEYS": "acme:key-acme-0123456789, globex:key-globex-0123456789,acme:key-acme-second-0123"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"key-acme-0123456789": "acme", "key-globex-0123456789": "globex", "key-acme-second-0123": "acme"}
	if len(c.APIKeys) != len(want) {
		t.Fatalf("APIKeys = %v", c.APIKeys)
	}
	for k, tenant := range want {
		if c.APIKeys[k] != tenant {
			t.Errorf("key %s -> %q, want %q", k, c.APIKeys[k], tenant)
		}
	}
	if got := strings.Join(c.Tenants(), ","); got != "acme,globex" {
		t.Errorf("Tenants = %s", got)
	}
	if err := c.RequireAPIKeys(); err != nil {
		t.Errorf("RequireAPIKeys: %v", err)
	}
	empty, _ := load(t, nil)
	if err := empty.RequireAPIKeys(); err == nil || !strings.Contains(err.Error(), "ONCEFLOW_API_KEYS") {
		t.Errorf("RequireAPIKeys without keys = %v", err)
	}
}

// No secret of the configuration is printed: not by Config's String and LogValue (the
// "starting ..." line every command logs), nor by RedactURL (the gateway's upstream
// attribute), nor in a load error.
func TestSecretsNeverPrinted(t *testing.T) {
	t.Parallel()
	t.Run("keys, passwords and tokens of every setting", func(t *testing.T) {
		secrets := []string{"key-acme-0123456789", "sk-openai-secret", "sk-ant-secret", "pgpassword", "redispassword", "smtppassword", "hooktoken"}
		c, err := load(t, map[string]string{
			"ONCEFLOW_API_KEYS":     "acme:key-acme-0123456789",
			"OPENAI_API_KEY":        "sk-openai-secret",
			"ANTHROPIC_API_KEY":     "sk-ant-secret",
			"ONCEFLOW_DATABASE_URL": "postgres://u:pgpassword@db:5432/x?sslmode=disable",
			"ONCEFLOW_REDIS_URL":    "redis://:redispassword@cache:6379/0",
			"ONCEFLOW_SENDER":       "smtp",
			"ONCEFLOW_SMTP_URL":     "smtp://mailer:smtppassword@mail:587",
			"ONCEFLOW_SMTP_FROM":    "noreply@example.com",
			"ONCEFLOW_WEBHOOK_URL":  "https://hooks.example.com/x?token=hooktoken",
		})
		if err != nil {
			t.Fatal(err)
		}
		var logged strings.Builder
		slog.New(slog.NewJSONHandler(&logged, nil)).Info("config", "config", c)
		slog.New(slog.NewTextHandler(&logged, nil)).Info("config", "config", c)
		for _, out := range []string{c.String(), logged.String()} {
			for _, s := range secrets {
				if strings.Contains(out, s) {
					t.Errorf("secret %q printed in:\n%s", s, out)
				}
			}
			for _, keep := range []string{"tenants acme", "db:5432", "cache:6379", "hooks.example.com", "mail:587"} {
				if !strings.Contains(out, keep) {
					t.Errorf("%q missing from:\n%s", keep, out)
				}
			}
		}
		// An invalid secret is not echoed in the error either.
		_, err = load(t, map[string]string{"ONCEFLOW_API_KEYS": "acme:supersecretbutshort\x01"})
		if err == nil || strings.Contains(err.Error(), "supersecret") {
			t.Errorf("error leaks the key: %v", err)
		}
		_, err = load(t, map[string]string{"ONCEFLOW_DATABASE_URL": "postgres://u:pgpassword@db:notaport/x"})
		if err == nil || strings.Contains(err.Error(), "pgpassword") {
			t.Errorf("error leaks the password: %v", err)
		}
		// A URL with a typo in its scheme has no user information to redact, but may still
		// hold a password.
		_, err = load(t, map[string]string{"ONCEFLOW_REDIS_URL": "redis//:redispassword@cache:6379"})
		if err == nil || strings.Contains(err.Error(), "redispassword") {
			t.Errorf("error leaks the password: %v", err)
		}
	})
	// pgx (like libpq) takes the password as a query parameter of the connection URI
	// (postgres://u@db/x?password=...), and an upstream may take its key in the query
	// (ONCEFLOW_LLM_BASE_URL=...?key=...).
	t.Run("passwords in a URL's query", func(t *testing.T) {
		c, err := load(t, map[string]string{
			"ONCEFLOW_DATABASE_URL": "postgres://onceflow@db:5432/onceflow?password=pg-query-secret&sslmode=disable",
			"ONCEFLOW_LLM_BASE_URL": "https://llm.example.com/v1?key=llm-query-secret",
		})
		if err != nil {
			t.Fatal(err)
		}
		var logged strings.Builder
		slog.New(slog.NewJSONHandler(&logged, nil)).Info("starting work", "config", c)
		outs := map[string]string{"config": c.String() + logged.String(),
			"RedactURL (the gateway's upstream attribute)": RedactURL(c.LLMBaseURL)}
		for what, out := range outs {
			for _, s := range []string{"pg-query-secret", "llm-query-secret"} {
				if strings.Contains(out, s) {
					t.Errorf("%s prints %q", what, s)
				}
			}
		}
	})
	// RedactURL hides the sentinels' password (the userinfo) and the primary's (the
	// password parameter), and keeps master_name and addr.
	t.Run("both passwords of a Sentinel URL", func(t *testing.T) {
		u := "redis://admin:sentPW1@s1:26379?addr=s2:26379&master_name=mymaster&username=app&password=primPW2"
		got := RedactURL(u)
		if strings.Contains(got, "sentPW1") || strings.Contains(got, "primPW2") {
			t.Fatalf("RedactURL(%s) = %s", u, got)
		}
		if !strings.Contains(got, "master_name=mymaster") || !strings.Contains(got, "s2%3A26379") && !strings.Contains(got, "s2:26379") {
			t.Fatalf("RedactURL lost the sentinel settings: %s", got)
		}
	})
}

func TestEveryFlagMatchesItsVariable(t *testing.T) {
	t.Parallel()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	Register(fs)
	for _, s := range settings {
		f := fs.Lookup(s.flag())
		if f == nil {
			t.Errorf("no flag for %s", s.env)
			continue
		}
		if !strings.Contains(f.Usage, s.env) {
			t.Errorf("flag --%s usage does not name %s", s.flag(), s.env)
		}
	}
	if fs.Lookup("claim-idle") == nil || fs.Lookup("redis-url") == nil || fs.Lookup("openai-api-key") == nil {
		t.Error("documented flag names missing")
	}
}

// docs/configuration.md is the user's reference: every setting has a row of its own in
// its tables ("| `NAME` | default | meaning |"), and every ONCEFLOW_ row there is a setting.
func TestConfigurationPageDocumentsEverySetting(t *testing.T) {
	t.Parallel()
	page, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([A-Z][A-Z0-9_]*)` \\|").FindAllStringSubmatch(string(page), -1) {
		rows[m[1]] = true
	}
	known := map[string]bool{}
	for _, s := range settings {
		known[s.env] = true
		if !rows[s.env] {
			t.Errorf("docs/configuration.md has no row for %s", s.env)
		}
	}
	for name := range rows {
		if strings.HasPrefix(name, "ONCEFLOW_") && !known[name] {
			t.Errorf("docs/configuration.md documents %s, which is not a setting", name)
		}
	}
}

func TestAdminKeysAreReadCheckedAndNeverATenantsKey(t *testing.T) {
	t.Parallel()
	c, err := load(t, nil)
	if err != nil || len(c.AdminKeys) != 0 || c.UISecureCookies {
		t.Fatalf("defaults: %v %v %v", c.AdminKeys, c.UISecureCookies, err)
	}
	c, err = load(t, map[string]string{"ONCEFLOW_ADMIN_KEYS": " admin-key-0123456789 ,second-admin-key-0123,admin-key-0123456789", "ONCEFLOW_UI_SECURE_COOKIES": "true"})
	if err != nil || !slices.Equal(c.AdminKeys, []string{"admin-key-0123456789", "second-admin-key-0123"}) || !c.UISecureCookies {
		t.Fatalf("%v %v %v", c.AdminKeys, c.UISecureCookies, err)
	}
	for _, bad := range []string{"short", "admin-key-0123456789,", "admin key 0123456789x"} {
		_, err := load(t, map[string]string{"ONCEFLOW_ADMIN_KEYS": bad})
		var ce *Error
		if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_ADMIN_KEYS" || strings.Contains(err.Error(), "0123456789") {
			t.Errorf("%q: %v (must name the variable, never echo a key)", bad, err)
		}
	}
	// A tenant's API key is never an admin key.
	_, err = load(t, map[string]string{"ONCEFLOW_API_KEYS": "acme:shared-key-0123456789", "ONCEFLOW_ADMIN_KEYS": "shared-key-0123456789"})
	var ce *Error
	if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_ADMIN_KEYS" || strings.Contains(err.Error(), "shared-key") {
		t.Fatalf("an admin key that is a tenant's: %v", err)
	}
}

func TestRedisClusterAddrs(t *testing.T) {
	t.Parallel()
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

func TestLedgerAndGatewaySettings(t *testing.T) {
	t.Parallel()
	c, err := load(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.LedgerRetention != 24*time.Hour || c.LedgerRelaxedInsert || c.GatewayTimeout != 5*time.Minute || c.GatewayMaxBody != 8<<20 {
		t.Fatalf("defaults: retention %v relaxed %v gateway timeout %v max body %d", c.LedgerRetention, c.LedgerRelaxedInsert, c.GatewayTimeout, c.GatewayMaxBody)
	}
	c, err = load(t, map[string]string{"ONCEFLOW_LEDGER_RELAXED_INSERT": "true", "ONCEFLOW_LEDGER_RETENTION": "72h", "ONCEFLOW_LEDGER_KEEP_REQUESTS": "true"})
	if err != nil || !c.LedgerRelaxedInsert || c.LedgerRetention != 72*time.Hour || !c.LedgerKeepRequests {
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

// Every setting is in exactly one group, so that a command's -h, which lists groups,
// can show any of them, and a group names only settings.
func TestEverySettingIsInOneGroup(t *testing.T) {
	t.Parallel()
	seen := map[string]Group{}
	for _, g := range Groups() {
		flags := g.Flags()
		if len(flags) == 0 {
			t.Errorf("group %q has no settings", g)
		}
		for _, f := range flags {
			if !IsFlag(f) {
				t.Errorf("group %q names --%s, which is no setting's flag", g, f)
			}
			if other, dup := seen[f]; dup {
				t.Errorf("--%s is in groups %q and %q", f, other, g)
			}
			seen[f] = g
		}
	}
	for _, s := range settings {
		if _, ok := seen[s.flag()]; !ok {
			t.Errorf("%s is in no group", s.env)
		}
	}
	if IsFlag("addr") || Group("no such group").Flags() != nil {
		t.Error("IsFlag or Flags answers for what is not a setting or a group")
	}
}

// ONCEFLOW_SHADOW gives the shadow runs; a bad entry names the variable and the entry.
func TestShadowSettingIsReadAndABadEntryNamesTheVariable(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_SHADOW": "summary=gpt-4.1-nano@0.25"})
	if err != nil || len(c.Shadows) != 1 || c.Shadows[0].Step != "summary" || c.Shadows[0].Model != "gpt-4.1-nano" || c.Shadows[0].Rate != 0.25 {
		t.Fatalf("%+v %v", c.Shadows, err)
	}
	if c, err := load(t, nil); err != nil || c.Shadows != nil {
		t.Fatalf("default: %+v %v", c.Shadows, err)
	}
	_, err = load(t, map[string]string{"ONCEFLOW_SHADOW": "summary=gpt-4.1-nano@3"})
	var ce *Error
	if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_SHADOW" || !strings.Contains(err.Error(), "want 0 to 1") {
		t.Fatalf("a rate of 3: %v", err)
	}
}

// The batch lane's settings: the summaries' lane, the size of a batch and its model's
// enqueued tokens, each checked against its bounds.
func TestBatchLaneSettings(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"ONCEFLOW_SUMMARIES_LANE": "batch", "ONCEFLOW_BATCH_MAX_SIZE": "1048576", "ONCEFLOW_BATCH_ENQUEUED_TOKENS": "2000000"})
	if err != nil || c.SummariesLane != "batch" || c.BatchMaxBytes != 1<<20 || c.BatchEnqueuedTokens != 2_000_000 {
		t.Fatalf("%q %d %d %v", c.SummariesLane, c.BatchMaxBytes, c.BatchEnqueuedTokens, err)
	}
	if c, err := load(t, nil); err != nil || c.SummariesLane != "sync" || c.BatchMaxBytes != 100<<20 || c.BatchEnqueuedTokens != 0 {
		t.Fatalf("defaults: %q %d %d %v", c.SummariesLane, c.BatchMaxBytes, c.BatchEnqueuedTokens, err)
	}
	for name, v := range map[string]string{"ONCEFLOW_SUMMARIES_LANE": "later", "ONCEFLOW_BATCH_MAX_SIZE": "10", "ONCEFLOW_BATCH_ENQUEUED_TOKENS": "-1"} {
		_, err := load(t, map[string]string{name: v})
		var ce *Error
		if !errors.As(err, &ce) || ce.Name != name {
			t.Errorf("%s=%s: %v, want an error naming the setting", name, v, err)
		}
	}
}

// ONCEFLOW_LEDGER_GROUP_LINGER takes what docs/configuration.md says: 100us by
// default, a duration from 1us to 5ms, or off (negative: group commit off); anything
// else stops the process naming the variable.
func TestLedgerGroupLingerTakesOneMicrosecondToFiveMillisecondsOrOff(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]time.Duration{"": 100 * time.Microsecond, "1us": time.Microsecond, "5ms": 5 * time.Millisecond, "off": -1} {
		c, err := load(t, map[string]string{"ONCEFLOW_LEDGER_GROUP_LINGER": v})
		if err != nil || c.LedgerGroupLinger != want {
			t.Errorf("ONCEFLOW_LEDGER_GROUP_LINGER=%q: %v %v, want %v", v, c.LedgerGroupLinger, err, want)
		}
	}
	for _, v := range []string{"abc", "0", "-1s", "999ns", "1ns", "5001us", "10s", "OFF"} {
		_, err := load(t, map[string]string{"ONCEFLOW_LEDGER_GROUP_LINGER": v})
		var ce *Error
		if !errors.As(err, &ce) || ce.Name != "ONCEFLOW_LEDGER_GROUP_LINGER" {
			t.Errorf("ONCEFLOW_LEDGER_GROUP_LINGER=%q: %v, want an error naming the variable", v, err)
		}
	}
}
