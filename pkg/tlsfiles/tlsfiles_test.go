package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/pkg/tlsfiles/tlsfilestest"
)

// handshake runs one TLS handshake between the two configurations over a
// pipe and returns the server's certificate serial seen by the client and
// the client's error (the server's error when the client saw none).
func handshake(t *testing.T, server, client *tls.Config) (int64, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	srvErr := make(chan error, 1)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			srvErr <- err
			return
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		s := tls.Server(conn, server)
		err = s.Handshake()
		if err == nil {
			// TLS 1.3: the server learns of a refused client certificate
			// only here; the client closes after its handshake.
			_, err = s.Read(make([]byte, 1))
			if errors.Is(err, io.EOF) {
				err = nil
			}
		}
		srvErr <- err
	}()
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	c := tls.Client(conn, client)
	err = c.Handshake()
	var serial int64
	if err == nil {
		serial = c.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
		_ = c.Close()
	} else {
		_ = conn.Close()
	}
	if serr := <-srvErr; err == nil {
		err = serr
	}
	return serial, err
}

func TestMutualTLSAndReload(t *testing.T) {
	dir, odir := t.TempDir(), t.TempDir()
	ca, other := tlsfilestest.NewCA(t, dir, "ca"), tlsfilestest.NewCA(t, odir, "other")
	caPath := ca.Path
	scert, skey := ca.Leaf(t, dir, "server", "127.0.0.1", 10)
	ccert, ckey := ca.Leaf(t, dir, "client", "client", 20)
	srv, err := NewReloader(Files{Cert: scert, Key: skey, CA: caPath}, nil)
	if err != nil {
		t.Fatal(err)
	}
	clock := time.Unix(1000, 0)
	srv.now, srv.lastCheck = func() time.Time { return clock }, clock
	cli, err := NewReloader(Files{Cert: ccert, Key: ckey, CA: caPath}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if serial, err := handshake(t, srv.ServerConfig(), cli.ClientConfig("127.0.0.1")); err != nil || serial != 10 {
		t.Fatalf("mutual TLS = serial %d, %v; want 10, nil", serial, err)
	}

	// Refusals.
	ocert, okey := other.Leaf(t, odir, "client", "client", 30)
	stranger, err := NewReloader(Files{Cert: ocert, Key: okey, CA: caPath}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := handshake(t, srv.ServerConfig(), stranger.ClientConfig("127.0.0.1")); err == nil {
		t.Error("a client certificate of another CA was accepted")
	}
	noCert := &tls.Config{MinVersion: tls.VersionTLS13, ServerName: "127.0.0.1", RootCAs: x509.NewCertPool()}
	noCert.RootCAs.AddCert(ca.Cert)
	if _, err := handshake(t, srv.ServerConfig(), noCert); err == nil {
		t.Error("a client without a certificate was accepted")
	}
	if _, err := handshake(t, srv.ServerConfig(), cli.ClientConfig("example.com")); err == nil || !strings.Contains(err.Error(), "verify the server") {
		t.Errorf("wrong server name = %v, want a verification error", err)
	}

	// Reload: a new server certificate is picked up once the check interval
	// has passed, not before.
	ca.Leaf(t, dir, "server", "127.0.0.1", 11)
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(scert, later, later); err != nil {
		t.Fatal(err)
	}
	if serial, err := handshake(t, srv.ServerConfig(), cli.ClientConfig("127.0.0.1")); err != nil || serial != 10 {
		t.Fatalf("within the check interval: serial %d, %v; want the old 10", serial, err)
	}
	clock = clock.Add(CheckInterval)
	if serial, err := handshake(t, srv.ServerConfig(), cli.ClientConfig("127.0.0.1")); err != nil || serial != 11 {
		t.Fatalf("after a reload: serial %d, %v; want 11", serial, err)
	}

	// A broken update keeps the previous material.
	tlsfilestest.Write(t, scert, []byte("not pem"))
	clock = clock.Add(CheckInterval)
	if serial, err := handshake(t, srv.ServerConfig(), cli.ClientConfig("127.0.0.1")); err != nil || serial != 11 {
		t.Fatalf("after a broken update: serial %d, %v; want the previous 11", serial, err)
	}
}

func TestNewReloaderErrors(t *testing.T) {
	dir := t.TempDir()
	ca := tlsfilestest.NewCA(t, dir, "ca")
	caPath := ca.Path
	cert, key := ca.Leaf(t, dir, "x", "x", 1)
	junk := filepath.Join(dir, "junk")
	tlsfilestest.Write(t, junk, []byte("junk"))
	for _, tc := range []struct {
		name string
		f    Files
		want string
	}{
		{"incomplete", Files{Cert: cert, Key: key}, "all three are required"},
		{"missing file", Files{Cert: cert, Key: key, CA: filepath.Join(dir, "nope")}, "failed to stat"},
		{"bad key", Files{Cert: cert, Key: junk, CA: caPath}, "failed to load TLS certificate"},
		{"bad CA", Files{Cert: cert, Key: key, CA: junk}, "no PEM certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewReloader(tc.f, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewReloader = %v, want %q", err, tc.want)
			}
		})
	}
}
