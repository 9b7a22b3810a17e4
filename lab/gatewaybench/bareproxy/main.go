// Command bareproxy is the gateway benchmark's reference proxy (lab/gatewaybench):
// net/http/httputil's ReverseProxy in front of one upstream, with the transport
// settings of onceflow gateway's default (up to 256 idle connections per host) and
// nothing else: no ledger, no parsing, no logging per request. What it costs against
// a direct call is what any HTTP proxy hop costs on the machine, the floor under the
// gateway's own overhead.
//
// Usage:
//
//	bareproxy -upstream http://127.0.0.1:PORT [-addr 127.0.0.1:0]
//
// It logs one JSON line {"msg":"bareproxy listening","addr":...} once it accepts
// connections, and stops on SIGTERM or SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if err := run(log); err != nil {
		log.Error("bareproxy", "err", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	upstream := flag.String("upstream", "", "base URL of the upstream (required)")
	addr := flag.String("addr", "127.0.0.1:0", "address to listen on")
	flag.Parse()
	u, err := url.Parse(*upstream)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return errors.New("-upstream must be an absolute URL")
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns, t.MaxIdleConnsPerHost = 256, 256
	rp := &httputil.ReverseProxy{
		Rewrite:       func(r *httputil.ProxyRequest) { r.SetURL(u) },
		Transport:     t,
		FlushInterval: -1, // pass streams on as they arrive, as the gateway does
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: rp, ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("bareproxy listening", "addr", ln.Addr().String())
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
