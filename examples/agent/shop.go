package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// Shop is the shop's own APIs that the agent's tools call: the orders API
// (GET {OrdersURL}/orders/{id}, whose answer names the order's "customer": the tenant
// of the customer's API key) and the payments API (POST {PaymentsURL} with an
// Idempotency-Key, which it honours: a repeated key gets the first answer). An order of
// another customer is answered as no such order, and never refunded. Its methods
// return the answer's body, the tool's result as the model reads it: a 4xx answer
// too, so the model can say what went wrong; a failure to get an answer, a 408, 409,
// 429 or 5xx is an error, which fails the job's delivery (retried). Safe for concurrent
// use.
type Shop struct {
	HTTP                   *http.Client // required; give it a timeout
	OrdersURL, PaymentsURL string
}

// notFound is the tools' answer about an order that is not the customer's.
const notFound = "error: no such order"

// Order returns order id as the orders API answers it, when it is customer's.
func (s *Shop) Order(ctx context.Context, customer, id string) (string, error) {
	return s.order(ctx, customer, id, "")
}

// order GETs order id (with query, "" for none) and returns it when it is customer's.
func (s *Shop) order(ctx context.Context, customer, id, query string) (string, error) {
	body, err := s.do(ctx, http.MethodGet, s.OrdersURL+"/orders/"+url.PathEscape(id)+query, "", nil)
	if err != nil || strings.HasPrefix(body, "error:") {
		return body, err
	}
	var o struct {
		Customer string `json:"customer"`
	}
	if json.Unmarshal([]byte(body), &o) != nil || o.Customer == "" || o.Customer != customer {
		return notFound, nil
	}
	return body, nil
}

// Refund asks the payments API to refund r under the Idempotency-Key key, once the
// orders API says the order is customer's (GET .../orders/{id}?fields=customer).
func (s *Shop) Refund(ctx context.Context, customer, key string, r RefundArgs) (string, error) {
	if ans, err := s.order(ctx, customer, r.Order, "?fields=customer"); err != nil || strings.HasPrefix(ans, "error:") {
		return ans, err
	}
	b, err := json.Marshal(r)
	if err != nil {
		return "", err
	}
	return s.do(ctx, http.MethodPost, s.PaymentsURL, key, b)
}

func (s *Shop) do(ctx context.Context, method, target, key string, body []byte) (string, error) {
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := s.HTTP.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	switch c := resp.StatusCode; {
	case err != nil:
		return "", fmt.Errorf("%s %s: read the answer: %w", method, target, err)
	case c >= 200 && c < 300:
		return string(b), nil
	case c >= 400 && c < 500 && c != http.StatusRequestTimeout && c != http.StatusConflict && c != http.StatusTooManyRequests:
		return fmt.Sprintf("error: %s: %s", resp.Status, b), nil
	}
	return "", fmt.Errorf("%s %s: %s", method, target, resp.Status)
}
