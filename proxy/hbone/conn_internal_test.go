package hbone

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"math/big"
	"net"
	"testing"
	"time"
)

// tlsPair returns the two ends of a TLS 1.3 connection over loopback TCP,
// each an hboneConn; the server end never reads unless the test does.
func tlsPair(t *testing.T) (client, server *hboneConn) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		DNSNames:     []string{"hbone.test"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(leaf)
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	type result struct {
		c   *hboneConn
		err error
	}
	accepted := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- result{err: err}
			return
		}
		raw := &recordBatcher{Conn: c}
		hc, err := handshake(context.Background(), raw,
			tls.Server(raw, &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}))
		if err != nil {
			_ = c.Close()
		}
		accepted <- result{hc, err}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	raw := &recordBatcher{Conn: c}
	client, err = handshake(context.Background(), raw,
		tls.Client(raw, &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, ServerName: "hbone.test"}))
	if err != nil {
		_ = c.Close()
		t.Fatal(err)
	}
	r := <-accepted
	if r.err != nil {
		_ = client.Close()
		t.Fatal(r.err)
	}
	t.Cleanup(func() {
		_ = client.Close()
		_ = r.c.Close()
	})
	return client, r.c
}

// TestBatchedWriteRoundTrip: records written in one batch arrive intact and
// in order, across batches larger than maxBatch.
func TestBatchedWriteRoundTrip(t *testing.T) {
	client, server := tlsPair(t)
	msg := make([]byte, 3*maxBatch+12345)
	for i := range msg {
		msg[i] = byte(i % 251)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := client.Write(msg)
		errc <- err
	}()
	got := make([]byte, len(msg))
	for n := 0; n < len(got); {
		m, err := server.Read(got[n:])
		if err != nil {
			t.Fatalf("read after %d bytes: %v", n, err)
		}
		n += m
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if got[i] != msg[i] {
			t.Fatalf("byte %d = %d, want %d", i, got[i], msg[i])
		}
	}
}

// TestCloseUnblocksWrite: Close during a Write that the peer does not read
// (blocked in the batch's write(2)) ends that Write with an error, as
// tls.Conn.Close does for a Write in flight; later Writes fail too.
func TestCloseUnblocksWrite(t *testing.T) {
	client, _ := tlsPair(t)
	big := make([]byte, 64<<20) // more than the socket buffers hold
	errc := make(chan error, 1)
	go func() {
		_, err := client.Write(big)
		errc <- err
	}()
	// Wait until the Write is under way (it cannot finish: nobody reads).
	for client.writing.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	if err := client.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		t.Logf("close: %v", err)
	}
	if err := <-errc; err == nil {
		t.Fatal("write to a closed connection succeeded")
	}
	if _, err := client.Write([]byte("x")); err == nil {
		t.Fatal("write after close succeeded")
	}
}
