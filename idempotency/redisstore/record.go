package redisstore

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/onceflow/onceflow/idempotency"
)

// A record is the string value of an idempotency key. Its first byte is its state, then
// comes the fingerprint and a newline, so that Lua can compare the fingerprint with one
// string.sub and tell the state by one byte:
//
//	P<fingerprint>\n<token>                          in progress (generic path)
//	D<fingerprint>\n<meta JSON>\n<body bytes>        done: meta is {"status":..,"header":..,"truncated":..}
//
// The body is stored raw (binary-safe), not inside the JSON.
const (
	stateInProgress = 'P'
	stateDone       = 'D'
	// maxFingerprint bounds a fingerprint's length (a SHA-256 hex is 64).
	maxFingerprint = 256
)

var errCorrupt = errors.New("corrupt idempotency record")

// record is a decoded record.
type record struct {
	state       byte
	fingerprint string
	token       string                // in progress only
	resp        *idempotency.Response // done only
}

type meta struct {
	Status    int         `json:"status"`
	Header    http.Header `json:"header,omitempty"`
	Truncated bool        `json:"truncated,omitempty"`
}

// checkFingerprint reports whether fp can be stored: 1 to 256 visible ASCII characters.
func checkFingerprint(fp string) error {
	if fp == "" || len(fp) > maxFingerprint {
		return fmt.Errorf("redisstore: fingerprint must be 1 to %d characters", maxFingerprint)
	}
	for i := 0; i < len(fp); i++ {
		if fp[i] <= ' ' || fp[i] > '~' {
			return errors.New("redisstore: fingerprint must be visible ASCII")
		}
	}
	return nil
}

func encodeMarker(fp, token string) string {
	return string(stateInProgress) + fp + "\n" + token
}

// encodeDone returns the done record of resp.
func encodeDone(fp string, resp *idempotency.Response) ([]byte, error) {
	if resp == nil || resp.Status < 100 || resp.Status > 999 {
		return nil, errors.New("redisstore: response needs a status from 100 to 999")
	}
	m, err := json.Marshal(meta{Status: resp.Status, Header: resp.Header, Truncated: resp.Truncated})
	if err != nil {
		return nil, fmt.Errorf("redisstore: encode response: %w", err)
	}
	b := make([]byte, 0, 2+len(fp)+len(m)+1+len(resp.Body))
	b = append(b, stateDone)
	b = append(b, fp...)
	b = append(b, '\n')
	b = append(b, m...)
	b = append(b, '\n')
	b = append(b, resp.Body...)
	return b, nil
}

// decodeRecord parses a record. It never panics; anything it does not understand is
// errCorrupt.
func decodeRecord(v string) (record, error) {
	if len(v) < 2 {
		return record{}, errCorrupt
	}
	nl := strings.IndexByte(v, '\n')
	if nl < 2 {
		return record{}, errCorrupt
	}
	rec := record{state: v[0], fingerprint: v[1:nl]}
	rest := v[nl+1:]
	switch rec.state {
	case stateInProgress:
		rec.token = rest
		return rec, nil
	case stateDone:
		end := strings.IndexByte(rest, '\n')
		if end < 0 {
			return record{}, errCorrupt
		}
		var m meta
		if err := json.Unmarshal([]byte(rest[:end]), &m); err != nil || m.Status < 100 || m.Status > 999 {
			return record{}, errCorrupt
		}
		body := rest[end+1:]
		rec.resp = &idempotency.Response{Status: m.Status, Header: m.Header, Truncated: m.Truncated}
		if body != "" {
			rec.resp.Body = []byte(body)
		}
		if rec.resp.Header == nil {
			rec.resp.Header = http.Header{}
		}
		return rec, nil
	}
	return record{}, errCorrupt
}
