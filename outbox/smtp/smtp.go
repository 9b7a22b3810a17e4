// Package smtp is an outbox.Sender that emails each message over SMTP with net/smtp.
//
// The URL selects the transport: smtp://user:pass@host:port upgrades to TLS with
// STARTTLS whenever the server offers it and authenticates with AUTH PLAIN when the URL
// has credentials; smtps://host:port speaks TLS from the first byte (implicit TLS).
// SMTP has no idempotency key: the message's Message-ID is derived from the dedupe key
// (MessageID), so a receiver that deduplicates on Message-ID sees a redelivered row as
// the same email, and one that does not shows it twice. docs/outbox.md has the window.
//
// The payload is a JSON object: "to" (required, one address), "subject" (default: the
// topic) and "body" (default: the payload, indented). From is Config.From
// (ONCEFLOW_SMTP_FROM).
package smtp

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"mime/quotedprintable"
	"net"
	"net/mail"
	"net/smtp"
	"net/textproto"
	"net/url"
	"strings"
	"time"

	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/retry"
)

// DefaultTimeout bounds one send, connection and TLS handshake included.
const DefaultTimeout = 30 * time.Second

// Config configures a Sender.
type Config struct {
	// URL is smtp://[user:pass@]host[:port] (port default 587) or
	// smtps://[user:pass@]host[:port] (port default 465). Required.
	URL string
	// From is the sender address (ONCEFLOW_SMTP_FROM). Required.
	From string
	// Timeout bounds one send. Default: 30s.
	Timeout time.Duration
	// TLSConfig verifies the server for STARTTLS and smtps. Default: the system roots,
	// with ServerName the URL's host.
	TLSConfig *tls.Config
	// LocalName is the name sent with EHLO. Default: localhost.
	LocalName string
}

// Sender emails outbox messages. It is safe for concurrent use; each Send opens its own
// connection.
type Sender struct {
	addr, host    string
	implicitTLS   bool
	auth          *url.Userinfo
	from          *mail.Address
	timeout       time.Duration
	tls           *tls.Config
	localName     string
	messageIDHost string
	wordEncoder   mime.WordEncoder
}

var _ outbox.Sender = (*Sender)(nil)

// New returns a Sender for cfg, or an error (which never shows the URL's password) when
// the URL or From is missing or malformed.
func New(cfg Config) (*Sender, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil {
		return nil, errors.New("smtp sender: URL is not a URL")
	}
	s := &Sender{host: u.Hostname(), auth: u.User, timeout: cfg.Timeout, localName: cfg.LocalName, wordEncoder: mime.QEncoding}
	port := u.Port()
	switch u.Scheme {
	case "smtp":
		port = cmp.Or(port, "587")
	case "smtps":
		s.implicitTLS, port = true, cmp.Or(port, "465")
	default:
		return nil, errors.New("smtp sender: URL scheme must be smtp or smtps")
	}
	if s.host == "" {
		return nil, errors.New("smtp sender: URL has no host")
	}
	s.addr = net.JoinHostPort(s.host, port)
	if s.from, err = mail.ParseAddress(cfg.From); err != nil || cfg.From == "" {
		return nil, fmt.Errorf("smtp sender: invalid From %q", cfg.From)
	}
	if s.timeout < 0 {
		return nil, errors.New("smtp sender: Timeout must not be negative")
	}
	if s.timeout == 0 {
		s.timeout = DefaultTimeout
	}
	s.localName = cmp.Or(s.localName, "localhost")
	if cfg.TLSConfig != nil {
		s.tls = cfg.TLSConfig.Clone()
	} else {
		s.tls = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if s.tls.ServerName == "" {
		s.tls.ServerName = s.host
	}
	_, s.messageIDHost, _ = strings.Cut(s.from.Address, "@")
	return s, nil
}

// MessageID returns the Message-ID header of the email for dedupeKey sent from the
// address from: the same key always gives the same id, so a receiver that deduplicates
// on Message-ID shows a redelivered row once.
func MessageID(dedupeKey, from string) string {
	_, host, _ := strings.Cut(from, "@")
	sum := sha256.Sum256([]byte("onceflow-outbox\x00" + dedupeKey))
	return "<" + hex.EncodeToString(sum[:20]) + "@" + cmp.Or(host, "onceflow.invalid") + ">"
}

// payload is the part of a message's payload the sender reads.
type payload struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Body    string `json:"body"`
}

// Send emails m to the payload's "to" with the Message-ID derived from m.DedupeKey. It
// returns nil once the server accepted the message (250 after DATA), a permanent error
// for an invalid payload, a 5xx reply or a configuration the server cannot satisfy
// (credentials but no AUTH), and a retryable error for 4xx replies, timeouts and
// connection or TLS failures. It returns when ctx is done or Timeout has passed.
func (s *Sender) Send(ctx context.Context, m outbox.Message) error {
	to, msg, err := s.compose(m, time.Now())
	if err != nil {
		return retry.Permanent(err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	if err := s.deliver(ctx, to, msg); err != nil {
		return classify(err)
	}
	return nil
}

// compose validates the payload and renders the RFC 5322 message.
func (s *Sender) compose(m outbox.Message, now time.Time) (*mail.Address, []byte, error) {
	var p payload
	if err := json.Unmarshal(m.Payload, &p); err != nil {
		return nil, nil, fmt.Errorf("smtp payload: %w", err)
	}
	to, err := mail.ParseAddress(p.To)
	if err != nil || p.To == "" {
		return nil, nil, fmt.Errorf("smtp payload: invalid \"to\" %q", p.To)
	}
	subject := cmp.Or(p.Subject, m.Topic)
	body := p.Body
	if body == "" {
		var buf bytes.Buffer
		if json.Indent(&buf, m.Payload, "", "  ") == nil {
			body = buf.String()
		}
	}
	var b bytes.Buffer
	header := func(k, v string) { fmt.Fprintf(&b, "%s: %s\r\n", k, v) }
	header("From", s.from.String())
	header("To", to.String())
	header("Subject", s.wordEncoder.Encode("utf-8", oneLine(subject)))
	header("Date", now.Format(time.RFC1123Z))
	header("Message-ID", MessageID(m.DedupeKey, s.from.Address))
	header("MIME-Version", "1.0")
	header("Content-Type", `text/plain; charset="utf-8"`)
	header("Content-Transfer-Encoding", "quoted-printable")
	b.WriteString("\r\n")
	qp := quotedprintable.NewWriter(&b)
	_, _ = qp.Write([]byte(strings.ReplaceAll(body, "\r\n", "\n")))
	_ = qp.Close()
	return to, b.Bytes(), nil
}

// oneLine keeps header values on one line whatever the payload holds.
func oneLine(s string) string {
	return strings.Join(strings.FieldsFunc(s, func(r rune) bool { return r == '\r' || r == '\n' }), " ")
}

// errConfig marks failures retrying cannot fix: the server does not offer what the URL
// asks for.
var errConfig = errors.New("smtp configuration")

// deliver runs one SMTP session: connect, EHLO, STARTTLS when offered, AUTH when the URL
// has credentials, MAIL, RCPT, DATA.
func (s *Sender) deliver(ctx context.Context, to *mail.Address, msg []byte) error {
	dialer := &net.Dialer{}
	var conn net.Conn
	var err error
	if s.implicitTLS {
		conn, err = (&tls.Dialer{NetDialer: dialer, Config: s.tls}).DialContext(ctx, "tcp", s.addr)
	} else {
		conn, err = dialer.DialContext(ctx, "tcp", s.addr)
	}
	if err != nil {
		return fmt.Errorf("smtp connect: %w", err)
	}
	if d, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(d)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() }) // cancellation interrupts I/O
	defer stop()
	c, err := smtp.NewClient(conn, s.host)
	if err != nil {
		_ = conn.Close()
		return ctxErr(ctx, fmt.Errorf("smtp greeting: %w", err))
	}
	defer c.Close()
	if err := c.Hello(s.localName); err != nil {
		return ctxErr(ctx, fmt.Errorf("smtp EHLO: %w", err))
	}
	if !s.implicitTLS {
		if ok, _ := c.Extension("STARTTLS"); ok {
			if err := c.StartTLS(s.tls); err != nil {
				return ctxErr(ctx, fmt.Errorf("smtp STARTTLS: %w", err))
			}
		}
	}
	if s.auth != nil && s.auth.Username() != "" {
		if ok, _ := c.Extension("AUTH"); !ok {
			return fmt.Errorf("%w: credentials given but the server offers no AUTH", errConfig)
		}
		pass, _ := s.auth.Password()
		if err := c.Auth(smtp.PlainAuth("", s.auth.Username(), pass, s.host)); err != nil {
			var tp *textproto.Error
			if !errors.As(err, &tp) { // net/smtp refuses PLAIN over an unencrypted remote connection
				return fmt.Errorf("%w: AUTH: %v", errConfig, err)
			}
			return ctxErr(ctx, fmt.Errorf("smtp AUTH: %w", err))
		}
	}
	if err := c.Mail(s.from.Address); err != nil {
		return ctxErr(ctx, fmt.Errorf("smtp MAIL FROM: %w", err))
	}
	if err := c.Rcpt(to.Address); err != nil {
		return ctxErr(ctx, fmt.Errorf("smtp RCPT TO: %w", err))
	}
	w, err := c.Data()
	if err != nil {
		return ctxErr(ctx, fmt.Errorf("smtp DATA: %w", err))
	}
	if _, err := w.Write(msg); err != nil {
		return ctxErr(ctx, fmt.Errorf("smtp DATA: %w", err))
	}
	if err := w.Close(); err != nil { // the server's answer to the final "."
		return ctxErr(ctx, fmt.Errorf("smtp DATA: %w", err))
	}
	_ = c.Quit() // accepted already: a failed QUIT changes nothing
	return nil
}

// ctxErr reports a context error when ctx ended, since closing the connection on
// cancellation surfaces as "use of closed network connection".
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	return err
}

// classify maps an SMTP failure onto the outbox's retry decision: 5xx replies and
// configuration mismatches are permanent; 4xx replies, timeouts and connection or TLS
// errors may succeed later.
func classify(err error) error {
	var tp *textproto.Error
	switch {
	case errors.Is(err, errConfig):
		return retry.Permanent(err)
	case errors.As(err, &tp) && tp.Code >= 500:
		return retry.Permanent(err)
	default:
		return err
	}
}
