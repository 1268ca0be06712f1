// Package tlsfiles builds mutual-TLS configurations from PEM files and
// reloads them when the files change (a Kubernetes Secret volume is updated
// in place), for the agent's TCP listeners and the clients that dial them.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// Files names the PEM files of one side of a mutual-TLS connection.
type Files struct {
	// Cert and Key are this side's certificate chain and private key.
	Cert, Key string
	// CA is the bundle that verifies the peer's certificate.
	CA string
}

// Complete reports whether all three files are named.
func (f Files) Complete() bool { return f.Cert != "" && f.Key != "" && f.CA != "" }

// Empty reports whether no file is named.
func (f Files) Empty() bool { return f.Cert == "" && f.Key == "" && f.CA == "" }

// CheckInterval is how often, at most, a handshake looks at the files'
// modification times.
const CheckInterval = time.Second

// material is one loaded generation of the files.
type material struct {
	cert *tls.Certificate
	pool *x509.CertPool
}

// Reloader holds the material of Files and reloads it, on a handshake, when
// a file's modification time or size changed. A reload that fails keeps the
// previous material and is logged, so a half-written Secret update never
// breaks serving.
type Reloader struct {
	files Files
	log   *slog.Logger
	now   func() time.Time

	mu        sync.Mutex
	cur       material
	stamp     string
	lastCheck time.Time
}

// NewReloader loads f (all three files are required) and returns a
// Reloader; log may be nil.
func NewReloader(f Files, log *slog.Logger) (*Reloader, error) {
	if !f.Complete() {
		return nil, fmt.Errorf("incomplete TLS files (cert %q, key %q, CA %q): all three are required", f.Cert, f.Key, f.CA)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := &Reloader{files: f, log: log, now: time.Now}
	m, stamp, err := load(f)
	if err != nil {
		return nil, err
	}
	r.cur, r.stamp, r.lastCheck = m, stamp, r.now()
	return r, nil
}

// stampOf is the files' modification times and sizes, to notice a change.
func stampOf(f Files) (string, error) {
	s := ""
	for _, p := range []string{f.Cert, f.Key, f.CA} {
		fi, err := os.Stat(p)
		if err != nil {
			return "", fmt.Errorf("failed to stat %q: %w", p, err)
		}
		s += fmt.Sprintf("%s:%d:%d;", p, fi.ModTime().UnixNano(), fi.Size())
	}
	return s, nil
}

func load(f Files) (material, string, error) {
	stamp, err := stampOf(f)
	if err != nil {
		return material{}, "", err
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return material{}, "", fmt.Errorf("failed to load TLS certificate %q and key %q: %w", f.Cert, f.Key, err)
	}
	caPEM, err := os.ReadFile(f.CA)
	if err != nil {
		return material{}, "", fmt.Errorf("failed to read CA bundle %q: %w", f.CA, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return material{}, "", fmt.Errorf("failed to parse CA bundle %q: no PEM certificate in it", f.CA)
	}
	return material{cert: &cert, pool: pool}, stamp, nil
}

// current returns the material, reloading it first when the files changed
// (looked at no more than once per CheckInterval).
func (r *Reloader) current() material {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if now.Sub(r.lastCheck) < CheckInterval {
		return r.cur
	}
	r.lastCheck = now
	stamp, err := stampOf(r.files)
	if err == nil && stamp == r.stamp {
		return r.cur
	}
	m, stamp, err := load(r.files)
	if err != nil {
		r.log.Warn("failed to reload TLS files; keeping the previous ones", "error", err.Error())
		return r.cur
	}
	r.cur, r.stamp = m, stamp
	r.log.Info("reloaded TLS files", "cert", r.files.Cert, "ca", r.files.CA)
	return r.cur
}

// ServerConfig is a TLS 1.3 server configuration that presents the current
// certificate and requires a client certificate that verifies against the
// current CA bundle. alpn are the protocols offered (gRPC needs "h2").
func (r *Reloader) ServerConfig(alpn ...string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: alpn,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			m := r.current()
			return &tls.Config{
				MinVersion:   tls.VersionTLS13,
				NextProtos:   alpn,
				Certificates: []tls.Certificate{*m.cert},
				ClientAuth:   tls.RequireAndVerifyClientCert,
				ClientCAs:    m.pool,
			}, nil
		},
	}
}

// ClientConfig is a TLS 1.3 client configuration that presents the current
// certificate and verifies the server against the current CA bundle and
// serverName (the server certificate's DNS name or IP address).
func (r *Reloader) ClientConfig(serverName string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		ServerName: serverName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return r.current().cert, nil
		},
		// The roots can rotate: verify by hand against the current pool.
		InsecureSkipVerify: true, //nolint:gosec // VerifyConnection below verifies chain and name.
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("server presented no certificate")
			}
			opts := x509.VerifyOptions{Roots: r.current().pool, DNSName: serverName, Intermediates: x509.NewCertPool()}
			for _, c := range cs.PeerCertificates[1:] {
				opts.Intermediates.AddCert(c)
			}
			if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
				return fmt.Errorf("failed to verify the server certificate: %w", err)
			}
			return nil
		},
	}
}
