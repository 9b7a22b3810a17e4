package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
)

// Shop is the shop's own APIs that the agent's tools call: the orders API
// (GET {OrdersURL}/orders/{id}) and the payments API (POST {PaymentsURL} with an
// Idempotency-Key, which it honours: a repeated key gets the first answer). Its methods
// return the answer's body, the tool's result as the model reads it: a 4xx answer
// too, so the model can say what went wrong; a failure to get an answer, a 408, 409,
// 429 or 5xx is an error, which fails the job's delivery (retried). Safe for concurrent
// use.
type Shop struct {
	HTTP                   *http.Client // required; give it a timeout
	OrdersURL, PaymentsURL string
}

// Order returns order id as the orders API answers it.
func (s *Shop) Order(ctx context.Context, id string) (string, error) {
	return s.do(ctx, http.MethodGet, s.OrdersURL+"/orders/"+url.PathEscape(id), "", nil)
}

// Refund asks the payments API to refund r under the Idempotency-Key key.
func (s *Shop) Refund(ctx context.Context, key string, r RefundArgs) (string, error) {
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
