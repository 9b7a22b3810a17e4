package onceflowotel

import (
	"net/http"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/trace"
)

// HTTPHandler returns h with a server span per request (otelhttp's), named after the
// matched http.ServeMux pattern ("POST /v1/tickets", else the method) and continuing
// the caller's W3C traceparent header when it sends one, so that the jobs the request
// enqueues (with Config.TraceParent set to TraceParent) are children of it. The probes
// and the scrape (/healthz, /readyz, /metrics) are not traced. Headers (Authorization,
// Idempotency-Key) are not recorded.
func HTTPHandler(tp trace.TracerProvider, h http.Handler) http.Handler {
	opts := []otelhttp.Option{
		otelhttp.WithPropagators(w3c),
		otelhttp.WithFilter(func(r *http.Request) bool {
			switch r.URL.Path {
			case "/healthz", "/readyz", "/metrics":
				return false
			}
			return true
		}),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
			if r.Pattern != "" {
				return r.Pattern
			}
			return r.Method
		}),
	}
	if tp != nil {
		opts = append(opts, otelhttp.WithTracerProvider(tp))
	}
	return otelhttp.NewHandler(h, "http", opts...)
}
