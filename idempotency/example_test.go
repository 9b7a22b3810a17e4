package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/idempotency/redisstore"
)

// principalKey is where an application's own authentication middleware would put the
// authenticated tenant.
type principalKey struct{}

// Wrap a handler so that retries with the same Idempotency-Key run it once. The tenant
// comes from the application's authentication (here a context value set by auth), never
// from a header the client controls.
func ExampleMiddleware_Wrap() {
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL"))
	if err != nil {
		panic(err)
	}
	defer rdb.Close()
	prefix := "example" + idempotency.NewToken()[:8]
	defer func() { // tidy up the example's keys
		keys, _ := rdb.Keys(context.Background(), prefix+":*").Result()
		if len(keys) > 0 {
			rdb.Del(context.Background(), keys...)
		}
	}()

	store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix})
	if err != nil {
		panic(err)
	}
	mw, err := idempotency.New(idempotency.Config{
		Store: store,
		Tenant: func(r *http.Request) (string, error) {
			if t, ok := r.Context().Value(principalKey{}).(string); ok {
				return t, nil
			}
			return "", errors.New("not authenticated")
		},
	})
	if err != nil {
		panic(err)
	}

	orders := 0
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		orders++ // the effect that must happen once
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", orders))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, orders)
	})
	auth := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer secret-key-of-acme" {
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, "acme")))
		})
	}
	srv := httptest.NewServer(auth(mw.Wrap(createOrder)))
	defer srv.Close()

	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku": "A-1", "qty": 2}`))
		req.Header.Set("Authorization", "Bearer secret-key-of-acme")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get("Location"), string(body), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("orders created:", orders)
	// Output:
	// 201 /orders/1 {"order":1} replayed: false
	// 201 /orders/1 {"order":1} replayed: true
	// orders created: 1
}

// Parse the Idempotency-Key header: the bare and the RFC 8941 quoted forms are the same
// key.
func ExampleParseKey() {
	bare, _ := idempotency.ParseKey(`8e03978e-40d5-43e8-bc93-6894a57f9324`)
	quoted, _ := idempotency.ParseKey(`"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
	fmt.Println(bare == quoted)
	_, err := idempotency.ParseKey("too-short")
	var ke *idempotency.KeyError
	if errors.As(err, &ke) {
		fmt.Println(ke.Detail)
	}
	// Output:
	// true
	// Idempotency-Key must be 16 to 128 characters, got 9
}

// Fingerprint a JSON body: whitespace and key order do not change it.
func ExampleCanonicalJSON() {
	a, _ := idempotency.CanonicalJSON([]byte(`{"text": "hi", "notify": "a@example.com"}`))
	b, _ := idempotency.CanonicalJSON([]byte("{\"notify\":\"a@example.com\",\n \"text\":\"hi\"}"))
	fmt.Println(string(a))
	fmt.Println(idempotency.Fingerprint(a) == idempotency.Fingerprint(b))
	// Output:
	// {"notify":"a@example.com","text":"hi"}
	// true
}
