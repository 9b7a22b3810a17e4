package webhook_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// A payments API that expects its own document gets the payload alone; the dedupe key
// is still its Idempotency-Key.
func ExamplePayloadOnly() {
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Println(r.Header.Get("Idempotency-Key"), string(body))
	}))
	defer api.Close()
	payments, err := webhook.New(webhook.Config{URL: api.URL + "/v1/refunds", Body: webhook.PayloadOnly})
	if err != nil {
		panic(err)
	}
	err = payments.Send(context.Background(), outbox.Message{Topic: "payments.refund", DedupeKey: "refund:ticket-42",
		Payload: json.RawMessage(`{"order_id":"order-9","amount_cents":1250}`)})
	fmt.Println(err)
	// Output:
	// refund:ticket-42 {"order_id":"order-9","amount_cents":1250}
	// <nil>
}
