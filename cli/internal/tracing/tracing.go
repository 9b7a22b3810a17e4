// Package tracing is the onceflow binary's OpenTelemetry setup: configuration from the
// standard OTEL_* environment variables and the tracer provider's start and shutdown
// (an OTLP/HTTP exporter behind a batch processor, the sampler the variables name).
// The spans themselves come from the public package onceflowotel, which library users
// import with a provider of their own; this package only builds the binary's.
//
// Tracing is off unless OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
// is set; then spans go to that collector over OTLP/HTTP. When it is off none of the
// wrappers is installed, so it costs nothing.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/config"
)

// Settings is the tracing configuration the standard variables describe.
type Settings struct {
	// Enabled: an OTLP endpoint is set and neither OTEL_SDK_DISABLED=true nor
	// OTEL_TRACES_EXPORTER=none turns tracing off.
	Enabled bool
	// Endpoint is where spans go, passwords and queries redacted, for logs.
	Endpoint string

	secrets []string // raw endpoint values, scrubbed from exporter errors
}

// FromEnv reads and validates the OpenTelemetry variables onceflow honours (the
// exporter reads most of them itself; this only checks them, so that a bad value stops
// the process at start like every setting). The first invalid one is returned as a
// *config.Error naming it; values that may hold secrets (headers, URLs) are redacted.
func FromEnv(getenv func(string) string) (Settings, error) {
	var s Settings
	bad := func(name, shown string, err error) (Settings, error) {
		return Settings{}, &config.Error{Name: name, Value: shown, Err: err}
	}
	disabled := false
	if v := getenv("OTEL_SDK_DISABLED"); v != "" {
		b, err := strconv.ParseBool(strings.ToLower(v))
		if err != nil {
			return bad("OTEL_SDK_DISABLED", v, errors.New("want true or false"))
		}
		disabled = b
	}
	switch v := getenv("OTEL_TRACES_EXPORTER"); v {
	case "", "otlp":
	case "none":
		disabled = true
	default:
		return bad("OTEL_TRACES_EXPORTER", v, errors.New("want otlp or none"))
	}
	base, traces := getenv("OTEL_EXPORTER_OTLP_ENDPOINT"), getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	for _, e := range []struct{ name, v string }{{"OTEL_EXPORTER_OTLP_ENDPOINT", base}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", traces}} {
		if e.v == "" {
			continue
		}
		if err := checkEndpoint(e.v); err != nil {
			return bad(e.name, redact(e.v), err)
		}
		s.secrets = append(s.secrets, e.v)
	}
	for _, sig := range []string{"", "TRACES_"} {
		p := "OTEL_EXPORTER_OTLP_" + sig
		switch v := getenv(p + "PROTOCOL"); v {
		case "", "http/protobuf", "http/json":
		default:
			return bad(p+"PROTOCOL", v, errors.New("onceflow exports over HTTP: want http/protobuf or http/json"))
		}
		switch v := getenv(p + "COMPRESSION"); v {
		case "", "gzip", "none":
		default:
			return bad(p+"COMPRESSION", v, errors.New("want gzip or none"))
		}
		if v := getenv(p + "TIMEOUT"); v != "" {
			if ms, err := strconv.Atoi(v); err != nil || ms < 0 {
				return bad(p+"TIMEOUT", v, errors.New("want milliseconds, a non-negative integer"))
			}
		}
		if v := getenv(p + "HEADERS"); v != "" {
			if err := checkHeaders(v); err != nil {
				return bad(p+"HEADERS", "[redacted]", err)
			}
		}
		if v := getenv(p + "INSECURE"); v != "" {
			if _, err := strconv.ParseBool(strings.ToLower(v)); err != nil {
				return bad(p+"INSECURE", v, errors.New("want true or false"))
			}
		}
	}
	sampler, arg := getenv("OTEL_TRACES_SAMPLER"), getenv("OTEL_TRACES_SAMPLER_ARG")
	switch sampler {
	case "", "always_on", "always_off", "parentbased_always_on", "parentbased_always_off":
	case "traceidratio", "parentbased_traceidratio":
		if arg != "" {
			if r, err := strconv.ParseFloat(arg, 64); err != nil || r < 0 || r > 1 {
				return bad("OTEL_TRACES_SAMPLER_ARG", arg, errors.New("want a ratio from 0 to 1"))
			}
		}
	default:
		return bad("OTEL_TRACES_SAMPLER", sampler, errors.New("want always_on, always_off, traceidratio or their parentbased_ forms"))
	}
	switch {
	case traces != "":
		s.Endpoint = redact(traces)
	case base != "":
		s.Endpoint = strings.TrimSuffix(redact(base), "/") + "/v1/traces"
	}
	s.Enabled = s.Endpoint != "" && !disabled
	return s, nil
}

// checkEndpoint accepts an http or https URL with a host and no query or fragment.
func checkEndpoint(v string) error {
	u, err := url.Parse(v)
	switch {
	case err != nil:
		return errors.New("not a URL") // url errors echo the value
	case u.Scheme != "http" && u.Scheme != "https":
		return errors.New("scheme must be http or https")
	case u.Host == "":
		return errors.New("missing host")
	case u.RawQuery != "" || u.Fragment != "":
		return errors.New("must not have a query or fragment")
	}
	return nil
}

// checkHeaders accepts key=value pairs separated by commas (W3C baggage format). Errors
// never quote a value: header values are usually credentials.
func checkHeaders(v string) error {
	for i, pair := range strings.Split(v, ",") {
		k, _, ok := strings.Cut(pair, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return fmt.Errorf("pair %d: want key=value", i+1)
		}
	}
	return nil
}

// redact shows a URL without its password and query; a value with an "@" that did not
// parse into user information may hide a password anywhere, so it is not shown at all.
func redact(v string) string {
	u, err := url.Parse(v)
	if err != nil || u.User == nil && strings.Contains(v, "@") {
		return "[redacted]"
	}
	if u.RawQuery != "" {
		u.RawQuery = "redacted"
	}
	return u.Redacted()
}

// Tracing is a running tracer provider. Its methods are safe for concurrent use.
type Tracing struct {
	provider *sdktrace.TracerProvider
}

// Start builds the tracer provider s describes: an OTLP/HTTP exporter (configured by the
// OTEL_EXPORTER_OTLP_* variables) behind a batch span processor, the sampler of
// OTEL_TRACES_SAMPLER (default: parent-based, always on), and a resource naming the
// service "onceflow" (OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win) at version. It
// installs it and the W3C trace-context propagator as the process's globals, and routes
// OpenTelemetry's own errors to log, with the endpoint's secrets scrubbed. s must be
// Enabled. Call Shutdown before exiting to flush the last spans.
func Start(ctx context.Context, s Settings, version string, log *slog.Logger) (*Tracing, error) {
	if !s.Enabled {
		return nil, errors.New("tracing: not enabled")
	}
	if log == nil {
		log = slog.Default()
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		msg := err.Error()
		for _, secret := range s.secrets {
			msg = strings.ReplaceAll(msg, secret, redact(secret))
		}
		log.Warn("opentelemetry", "err", msg)
	}))
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("otlp trace exporter: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithSchemaURL(semconv.SchemaURL),
		resource.WithAttributes(semconv.ServiceName("onceflow"), semconv.ServiceVersion(version)),
		resource.WithFromEnv(), resource.WithTelemetrySDK(), resource.WithHost(), resource.WithProcessPID())
	if err != nil {
		log.Warn("opentelemetry resource incomplete", "err", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	return &Tracing{provider: tp}, nil
}

// Provider returns the tracer provider to give onceflowotel's wrappers.
func (t *Tracing) Provider() trace.TracerProvider { return t.provider }

// Shutdown flushes the spans not yet exported and stops the exporter, within ctx.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if err := t.provider.Shutdown(ctx); err != nil {
		return fmt.Errorf("tracing shutdown: %w", err)
	}
	return nil
}
