package smtp_test

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"math/big"
	"net"
	"net/textproto"
	"strings"
	"sync"
	"testing"
	"time"
)

// smtpd is an in-process SMTP server speaking real SMTP over TCP: EHLO, STARTTLS (when
// it has a certificate), AUTH PLAIN (when it has a user, and only over TLS), MAIL,
// RCPT, DATA, RSET, NOOP, QUIT. It stands in for the email provider.
type smtpd struct {
	t         *testing.T
	ln        net.Listener
	tls       *tls.Config // STARTTLS offered when set (and not implicit)
	implicit  bool        // TLS from the first byte (smtps)
	user      string      // AUTH PLAIN required when set
	pass      string
	mailReply string // e.g. "451 try later": the answer to MAIL FROM, once set
	rcptReply string // e.g. "550 no such user"

	mu   sync.Mutex
	msgs []received
}

type received struct {
	From, To string
	Data     string
	TLS      bool
	User     string
}

func startSMTPD(t *testing.T, configure func(*smtpd)) *smtpd {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &smtpd{t: t, ln: ln}
	if configure != nil {
		configure(s)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go s.serve(c)
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return s
}

func (s *smtpd) addr() string { return s.ln.Addr().String() }

func (s *smtpd) received() []received {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]received(nil), s.msgs...)
}

func (s *smtpd) serve(c net.Conn) {
	defer func() { c.Close() }()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	tlsOn := false
	if s.implicit {
		tc := tls.Server(c, s.tls)
		if tc.Handshake() != nil {
			return
		}
		c, tlsOn = tc, true
	}
	tp := textproto.NewConn(c)
	reply := func(lines ...string) {
		for _, l := range lines {
			_ = tp.PrintfLine("%s", l)
		}
	}
	reply("220 smtpd.test ESMTP")
	var from, to, user string
	for {
		line, err := tp.ReadLine()
		if err != nil {
			return
		}
		verb, arg, _ := strings.Cut(line, " ")
		switch strings.ToUpper(verb) {
		case "EHLO", "HELO":
			lines := []string{"250-smtpd.test"}
			if s.tls != nil && !tlsOn {
				lines = append(lines, "250-STARTTLS")
			}
			if s.user != "" && tlsOn {
				lines = append(lines, "250-AUTH PLAIN")
			}
			reply(append(lines, "250 8BITMIME")...)
		case "STARTTLS":
			if s.tls == nil || tlsOn {
				reply("502 not now")
				continue
			}
			reply("220 go ahead")
			tc := tls.Server(c, s.tls)
			if tc.Handshake() != nil {
				return
			}
			c, tlsOn = tc, true
			tp = textproto.NewConn(c)
			from, to, user = "", "", ""
		case "AUTH":
			mech, ir, _ := strings.Cut(arg, " ")
			if mech != "PLAIN" || s.user == "" || !tlsOn {
				reply("504 unsupported")
				continue
			}
			if ir == "" {
				reply("334 ")
				if ir, err = tp.ReadLine(); err != nil {
					return
				}
			}
			dec, _ := base64.StdEncoding.DecodeString(ir)
			parts := bytes.Split(dec, []byte{0})
			if len(parts) != 3 || string(parts[1]) != s.user || string(parts[2]) != s.pass {
				reply("535 5.7.8 authentication failed")
				continue
			}
			user = s.user
			reply("235 2.7.0 ok")
		case "MAIL":
			switch {
			case s.user != "" && user == "":
				reply("530 5.7.0 authentication required")
			case s.mailReply != "":
				reply(s.mailReply)
			default:
				from = strings.TrimPrefix(arg, "FROM:")
				reply("250 ok")
			}
		case "RCPT":
			if s.rcptReply != "" {
				reply(s.rcptReply)
				continue
			}
			to = strings.TrimPrefix(arg, "TO:")
			reply("250 ok")
		case "DATA":
			reply("354 go on")
			data, err := tp.ReadDotBytes()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, received{From: from, To: to, Data: string(data), TLS: tlsOn, User: user})
			s.mu.Unlock()
			reply("250 2.0.0 queued")
		case "RSET":
			from, to = "", ""
			reply("250 ok")
		case "NOOP":
			reply("250 ok")
		case "QUIT":
			reply("221 bye")
			return
		default:
			reply("502 unknown command")
		}
	}
}

// testCert returns a server config with a fresh self-signed certificate for 127.0.0.1
// and a client config that trusts it.
func testCert(t *testing.T) (server, client *tls.Config) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "smtpd.test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}},
		&tls.Config{RootCAs: pool}
}
