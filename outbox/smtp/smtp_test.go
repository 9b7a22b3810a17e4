package smtp_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"mime/quotedprintable"
	"net"
	"net/mail"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/smtp"
	"github.com/onceflow/onceflow/retry"
)

const from = "onceflow <noreply@mail.example.com>"

func message(key, payload string) outbox.Message {
	return outbox.Message{ID: 1, Topic: "email.summary_ready", DedupeKey: key, Payload: json.RawMessage(payload)}
}

func newSender(t *testing.T, url string, tlsConf *tls.Config) *smtp.Sender {
	t.Helper()
	s, err := smtp.New(smtp.Config{URL: url, From: from, TLSConfig: tlsConf, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func parse(t *testing.T, data string) (*mail.Message, string) {
	t.Helper()
	m, err := mail.ReadMessage(strings.NewReader(data))
	if err != nil {
		t.Fatalf("received message does not parse: %v\n%s", err, data)
	}
	body, err := io.ReadAll(quotedprintable.NewReader(m.Body))
	if err != nil {
		t.Fatal(err)
	}
	return m, string(body)
}

func TestSTARTTLSAndAuthPlainDeliverWithADeterministicMessageID(t *testing.T) {
	t.Parallel()
	serverTLS, clientTLS := testCert(t)
	d := startSMTPD(t, func(s *smtpd) { s.tls, s.user, s.pass = serverTLS, "mailer", "s3cret" })
	s := newSender(t, "smtp://mailer:s3cret@"+d.addr(), clientTLS)
	ctx := context.Background()
	payload := `{"job_id":"j1","to":"Ann <ann@example.com>","subject":"Your summary\r\nBcc: evil@example.com","body":"Line one\n.\nLine three é"}`
	for range 2 { // the same row twice, as after a crash between send and commit
		if err := s.Send(ctx, message("summary_ready:j1", payload)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Send(ctx, message("summary_ready:j2", `{"to":"bob@example.com"}`)); err != nil {
		t.Fatal(err)
	}
	got := d.received()
	if len(got) != 3 {
		t.Fatalf("%d messages received, want 3", len(got))
	}
	r := got[0]
	if !r.TLS || r.User != "mailer" || !strings.HasPrefix(r.From, "<noreply@mail.example.com>") || r.To != "<ann@example.com>" {
		t.Fatalf("envelope %+v: want TLS, AUTH as mailer, the From and the payload's to", r)
	}
	m, body := parse(t, r.Data)
	if m.Header.Get("Bcc") != "" || strings.Contains(r.Data, "\r\nBcc:") {
		t.Fatalf("a CRLF in the subject injected a header:\n%s", r.Data)
	}
	if subj, _ := new(mime.WordDecoder).DecodeHeader(m.Header.Get("Subject")); subj != "Your summary Bcc: evil@example.com" {
		t.Errorf("subject %q", subj)
	}
	if strings.TrimRight(strings.ReplaceAll(body, "\r\n", "\n"), "\n") != "Line one\n.\nLine three é" {
		t.Errorf("body %q", body)
	}
	id0 := m.Header.Get("Message-Id")
	m1, _ := parse(t, got[1].Data)
	m2, body2 := parse(t, got[2].Data)
	if id0 == "" || id0 != m1.Header.Get("Message-Id") || id0 != smtp.MessageID("summary_ready:j1", "noreply@mail.example.com") {
		t.Errorf("Message-ID %q, %q: want the same, derived from the dedupe key", id0, m1.Header.Get("Message-Id"))
	}
	if m2.Header.Get("Message-Id") == id0 || !strings.HasSuffix(id0, "@mail.example.com>") {
		t.Errorf("Message-IDs %q and %q", id0, m2.Header.Get("Message-Id"))
	}
	if m2.Header.Get("Subject") != "email.summary_ready" || !strings.Contains(body2, `"to": "bob@example.com"`) {
		t.Errorf("defaults: subject %q body %q", m2.Header.Get("Subject"), body2)
	}
}

func TestImplicitTLS(t *testing.T) {
	t.Parallel()
	serverTLS, clientTLS := testCert(t)
	d := startSMTPD(t, func(s *smtpd) { s.tls, s.implicit = serverTLS, true })
	if err := newSender(t, "smtps://"+d.addr(), clientTLS).Send(context.Background(), message("k", `{"to":"a@example.com"}`)); err != nil {
		t.Fatal(err)
	}
	if got := d.received(); len(got) != 1 || !got[0].TLS {
		t.Fatalf("received %+v, want one message over TLS", got)
	}
	// A server certificate the client does not trust: no delivery, and retryable.
	err := newSender(t, "smtps://"+d.addr(), nil).Send(context.Background(), message("k", `{"to":"a@example.com"}`))
	if err == nil || retry.IsPermanent(err) || len(d.received()) != 1 {
		t.Fatalf("untrusted certificate: %v", err)
	}
}

func TestPlainSMTPWhenNoTLSIsOffered(t *testing.T) {
	t.Parallel()
	d := startSMTPD(t, nil)
	if err := newSender(t, "smtp://"+d.addr(), nil).Send(context.Background(), message("k", `{"to":"a@example.com"}`)); err != nil {
		t.Fatal(err)
	}
	if got := d.received(); len(got) != 1 || got[0].TLS {
		t.Fatalf("received %+v", got)
	}
}

func TestFailureClassification(t *testing.T) {
	t.Parallel()
	serverTLS, clientTLS := testCert(t)
	ok := `{"to":"a@example.com"}`
	cases := []struct {
		name      string
		configure func(*smtpd)
		url       string // %s is the address
		payload   string
		permanent bool
	}{
		{"4xx on MAIL", func(s *smtpd) { s.mailReply = "451 4.3.0 try again later" }, "smtp://%s", ok, false},
		{"5xx on RCPT", func(s *smtpd) { s.rcptReply = "550 5.1.1 no such user" }, "smtp://%s", ok, true},
		{"wrong password", func(s *smtpd) { s.tls, s.user, s.pass = serverTLS, "mailer", "right" }, "smtp://mailer:wrong@%s", ok, true},
		{"credentials but no AUTH offered", nil, "smtp://mailer:pw@%s", ok, true},
		{"payload without to", nil, "smtp://%s", `{"subject":"x"}`, true},
		{"payload not an object", nil, "smtp://%s", `[1,2]`, true},
		{"bad address", nil, "smtp://%s", `{"to":"not an address"}`, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			d := startSMTPD(t, c.configure)
			err := newSender(t, strings.Replace(c.url, "%s", d.addr(), 1), clientTLS).Send(context.Background(), message("k", c.payload))
			if err == nil || retry.IsPermanent(err) != c.permanent {
				t.Fatalf("err %v, permanent %v; want permanent %v", err, retry.IsPermanent(err), c.permanent)
			}
			if strings.Contains(err.Error(), "wrong") || strings.Contains(err.Error(), "right") {
				t.Fatalf("error shows a password: %v", err)
			}
			if len(d.received()) != 0 {
				t.Fatal("message delivered despite the failure")
			}
		})
	}
}

func TestConnectionErrorsAndHangsAreRetryable(t *testing.T) {
	t.Parallel()
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	err := newSender(t, "smtp://"+addr, nil).Send(context.Background(), message("k", `{"to":"a@example.com"}`))
	if err == nil || retry.IsPermanent(err) {
		t.Fatalf("refused: %v", err)
	}
	// A server that accepts and never greets: the per-send timeout ends the attempt.
	hang, _ := net.Listen("tcp", "127.0.0.1:0")
	defer hang.Close()
	go func() {
		for {
			c, err := hang.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	s, _ := smtp.New(smtp.Config{URL: "smtp://" + hang.Addr().String(), From: from, Timeout: 200 * time.Millisecond})
	start := time.Now()
	err = s.Send(context.Background(), message("k", `{"to":"a@example.com"}`))
	if err == nil || retry.IsPermanent(err) || !errors.Is(err, context.DeadlineExceeded) && !isTimeout(err) {
		t.Fatalf("hung server: %v, want a retryable timeout", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("timeout not applied: %v", time.Since(start))
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	for _, c := range []smtp.Config{
		{URL: "http://h", From: from}, {URL: "smtp://", From: from}, {URL: "smtp://h:25"}, {URL: "smtp://h:25", From: "nope"},
	} {
		if _, err := smtp.New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
	_, err := smtp.New(smtp.Config{URL: "smtp://u:topsecret@h:25", From: "bad"})
	if err == nil || strings.Contains(err.Error(), "topsecret") {
		t.Errorf("error %v", err)
	}
}

// The payload comes from the database, but its subject and addresses are user data:
// whatever they hold, the rendered headers keep their shape (no injected header).
func FuzzSendNeverInjectsHeaders(f *testing.F) {
	f.Add("a@example.com", "hello", "body")
	f.Add("Ann <ann@example.com>", "x\r\nBcc: e@example.com", "\r\n.\r\n")
	f.Add("a@example.com", "=?utf-8?q?x?=\n\nbody", "")
	f.Fuzz(func(t *testing.T, to, subject, body string) {
		srv := startSMTPD(t, nil)
		s := newSender(t, "smtp://"+srv.addr(), nil)
		p, _ := json.Marshal(map[string]string{"to": to, "subject": subject, "body": body})
		if err := s.Send(context.Background(), message("k", string(p))); err != nil {
			return // rejected input is fine; it must only never be mangled into headers
		}
		got := srv.received()
		if len(got) != 1 {
			t.Fatalf("%d messages", len(got))
		}
		m, err := mail.ReadMessage(strings.NewReader(got[0].Data))
		if err != nil {
			t.Fatalf("unparseable message: %v", err)
		}
		for k := range m.Header {
			switch k {
			case "From", "To", "Subject", "Date", "Message-Id", "Mime-Version", "Content-Type", "Content-Transfer-Encoding":
			default:
				t.Fatalf("unexpected header %q in\n%s", k, got[0].Data)
			}
		}
	})
}
