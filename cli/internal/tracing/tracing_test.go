package tracing

import (
	"errors"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/config"
)

func env(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

func TestFromEnvIsOffUnlessAnEndpointIsSet(t *testing.T) {
	cases := []struct {
		env      []string
		enabled  bool
		endpoint string
	}{
		{nil, false, ""},
		{[]string{"OTEL_SERVICE_NAME", "api"}, false, ""},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"}, true, "http://collector:4318/v1/traces"},
		{[]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://collector/custom"}, true, "https://collector/custom"},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "https://u:hunter2@collector:4318/"}, true, "https://u:xxxxx@collector:4318/v1/traces"},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318", "OTEL_SDK_DISABLED", "true"}, false, "http://c:4318/v1/traces"},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318", "OTEL_TRACES_EXPORTER", "none"}, false, "http://c:4318/v1/traces"},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318", "OTEL_TRACES_SAMPLER", "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG", "0.25"}, true, "http://c:4318/v1/traces"},
	}
	for _, tc := range cases {
		s, err := FromEnv(env(tc.env...))
		if err != nil {
			t.Errorf("%v: %v", tc.env, err)
			continue
		}
		if s.Enabled != tc.enabled || s.Endpoint != tc.endpoint {
			t.Errorf("%v: enabled %v endpoint %q, want %v %q", tc.env, s.Enabled, s.Endpoint, tc.enabled, tc.endpoint)
		}
	}
}

func TestFromEnvNamesTheBadVariableAndHidesSecrets(t *testing.T) {
	cases := []struct {
		env  []string
		name string
	}{
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector"}, "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{[]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://:hunter2@/x"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"},
		{[]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c/v1/traces?token=hunter2"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"},
		{[]string{"OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{[]string{"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"}, "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"},
		{[]string{"OTEL_EXPORTER_OTLP_TIMEOUT", "10s"}, "OTEL_EXPORTER_OTLP_TIMEOUT"},
		{[]string{"OTEL_EXPORTER_OTLP_HEADERS", "api-key hunter2"}, "OTEL_EXPORTER_OTLP_HEADERS"},
		{[]string{"OTEL_EXPORTER_OTLP_INSECURE", "maybe"}, "OTEL_EXPORTER_OTLP_INSECURE"},
		{[]string{"OTEL_TRACES_SAMPLER", "sometimes"}, "OTEL_TRACES_SAMPLER"},
		{[]string{"OTEL_TRACES_SAMPLER", "traceidratio", "OTEL_TRACES_SAMPLER_ARG", "2"}, "OTEL_TRACES_SAMPLER_ARG"},
		{[]string{"OTEL_TRACES_EXPORTER", "zipkin"}, "OTEL_TRACES_EXPORTER"},
		{[]string{"OTEL_SDK_DISABLED", "yes please"}, "OTEL_SDK_DISABLED"},
	}
	for _, tc := range cases {
		_, err := FromEnv(env(tc.env...))
		var ce *config.Error
		if !errors.As(err, &ce) || ce.Name != tc.name {
			t.Errorf("%v: error %v, want a *config.Error naming %s", tc.env, err, tc.name)
			continue
		}
		if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%v: error shows the secret: %v", tc.env, err)
		}
	}
}

// FromEnv never panics, and its errors never quote a header value or a URL's password.
func FuzzFromEnv(f *testing.F) {
	f.Add("http://c:4318", "k=v", "gzip", "0.5")
	f.Add("http://u:pw@c:4318/x", "a=b,c", "none", "x")
	f.Add("::", "=", "", "")
	f.Fuzz(func(t *testing.T, endpoint, headers, compression, ratio string) {
		const secret = "Zsecret9"
		_, err := FromEnv(env("OTEL_EXPORTER_OTLP_ENDPOINT", strings.Replace(endpoint, "//", "//u:"+secret+"@", 1),
			"OTEL_EXPORTER_OTLP_HEADERS", headers+",x="+secret, "OTEL_EXPORTER_OTLP_COMPRESSION", compression,
			"OTEL_TRACES_SAMPLER", "traceidratio", "OTEL_TRACES_SAMPLER_ARG", ratio))
		if err != nil && strings.Contains(err.Error(), secret) {
			t.Fatalf("error quotes a secret: %v", err)
		}
	})
}
