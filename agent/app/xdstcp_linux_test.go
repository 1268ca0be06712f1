package app

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"aether.io/node/pkg/tlsfiles"
	"aether.io/node/pkg/tlsfiles/tlsfilestest"
	"aether.io/node/xds/workload/client"
)

// freeTCPAddr is a loopback address with a port nothing listens on now.
func freeTCPAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// TestXDSAddressMutualTLS serves workload discovery on --xds-address with
// mutual TLS: aetherctl workloads with a client certificate of the client
// CA lists the workloads; without a certificate, with one of another CA,
// or without TLS at all it is refused; a request larger than
// --xds-max-recv-bytes is refused with ResourceExhausted.
func TestXDSAddressMutualTLS(t *testing.T) {
	dir, odir := t.TempDir(), t.TempDir()
	ca, other := tlsfilestest.NewCA(t, dir, "ca"), tlsfilestest.NewCA(t, odir, "other")
	scert, skey := ca.Leaf(t, dir, "server", "127.0.0.1", 2)
	ccert, ckey := ca.Leaf(t, dir, "client", "spiffe://cluster.local/ns/aether-system/sa/reader", 3)
	ocert, okey := other.Leaf(t, odir, "client", "client", 4)
	addr := freeTCPAddr(t)
	c := testConfig(t, "--xds-address", addr, "--xds-tls-cert", scert, "--xds-tls-key", skey, "--xds-client-ca", ca.Path,
		"--xds-max-recv-bytes", "65536")
	ctx, done := runAgent(t, c)
	waitServing(ctx, t, c, done)

	list := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := client.Run(ctx, append([]string{"--xds-address", addr, "-o", "json"}, args...), &out)
		return out.String(), err
	}
	if out, err := list("--tls-cert", ccert, "--tls-key", ckey, "--tls-ca", ca.Path); err != nil || strings.TrimSpace(out) != "[]" {
		t.Fatalf("workloads over mutual TLS = %q, %v; want [] (no pods)", out, err)
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"no TLS", nil},
		{"client certificate of another CA", []string{"--tls-cert", ocert, "--tls-key", okey, "--tls-ca", ca.Path}},
	} {
		if out, err := list(tc.args...); err == nil {
			t.Errorf("%s: served %q; want a refusal", tc.name, out)
		}
	}

	// A reconnect whose initial_resource_versions exceed the limit.
	r, err := tlsfiles.NewReloader(tlsfiles.Files{Cert: ccert, Key: ckey, CA: ca.Path}, nil)
	if err != nil {
		t.Fatal(err)
	}
	versions := map[string]string{}
	for i := range 4000 {
		versions[fmt.Sprintf("Kubernetes/apps/ns/pod-%05d", i)] = "v1"
	}
	cl, err := client.Dial(ctx, client.Options{Address: addr, TLS: r.ClientConfig("127.0.0.1"), InitialVersions: versions})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cl.Close() }()
	if _, err := cl.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("oversized request = %v, want ResourceExhausted", err)
	}
}

// TestXDSAddressStuckHandshakesFreeTheirSlots fills every connection slot
// of --xds-address (and more, queued in the accept backlog) with
// connections that start a TLS handshake and never finish it: each is
// closed by the agent once --xds-handshake-timeout passes, which frees its
// slot, and a real client with a certificate is then served. The test
// asserts behaviour, not times: every stuck connection ends by the
// server's close (never by the test's guard deadline), and the client
// gets its answer.
func TestXDSAddressStuckHandshakesFreeTheirSlots(t *testing.T) {
	dir := t.TempDir()
	ca := tlsfilestest.NewCA(t, dir, "ca")
	scert, skey := ca.Leaf(t, dir, "server", "127.0.0.1", 2)
	ccert, ckey := ca.Leaf(t, dir, "client", "spiffe://cluster.local/ns/aether-system/sa/reader", 3)
	addr := freeTCPAddr(t)
	c := testConfig(t, "--xds-address", addr, "--xds-tls-cert", scert, "--xds-tls-key", skey, "--xds-client-ca", ca.Path,
		"--xds-handshake-timeout", "300ms")
	ctx, done := runAgent(t, c)
	waitServing(ctx, t, c, done)

	const stuck = xdsTCPMaxConns + 44
	conns := make([]net.Conn, 0, stuck)
	t.Cleanup(func() {
		for _, s := range conns {
			_ = s.Close()
		}
	})
	for range stuck {
		s, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, s)
		// The first bytes of a TLS record header: the server waits for
		// the rest of the ClientHello.
		if _, err := s.Write([]byte{0x16, 0x03, 0x01}); err != nil {
			t.Fatal(err)
		}
	}

	// A real client queues behind them and is served once slots free.
	served := make(chan error, 1)
	go func() {
		var out bytes.Buffer
		err := client.Run(ctx, []string{"--xds-address", addr, "-o", "json", "--tls-cert", ccert, "--tls-key", ckey, "--tls-ca", ca.Path}, &out)
		if err == nil && strings.TrimSpace(out.String()) != "[]" {
			err = fmt.Errorf("workloads = %q, want []", out.String())
		}
		served <- err
	}()

	// Every stuck connection is closed by the agent: a read returns EOF
	// or a reset, not the guard deadline (a hang guard, far beyond any
	// handshake timeout).
	for i, s := range conns {
		_ = s.SetReadDeadline(time.Now().Add(2 * time.Minute))
		_, err := s.Read(make([]byte, 64))
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("stuck connection %d still open at the guard deadline: the agent never closed it", i)
		}
		if err == nil {
			t.Fatalf("stuck connection %d got bytes; want it closed", i)
		}
	}
	if err := <-served; err != nil {
		t.Fatalf("real client after %d stuck handshakes: %v", stuck, err)
	}
}

// TestXDSHandshakeTimeoutFlag: --xds-handshake-timeout must be positive
// and at most a minute.
func TestXDSHandshakeTimeoutFlag(t *testing.T) {
	for _, v := range []string{"0s", "-1s", "2m"} {
		_, err := ParseFlags([]string{"--node-name", "n1", "--xds-address", "127.0.0.1:0", "--xds-handshake-timeout", v}, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "invalid --xds-handshake-timeout") {
			t.Errorf("--xds-handshake-timeout %s: %v; want an invalid flag error", v, err)
		}
	}
	c, err := ParseFlags([]string{"--node-name", "n1", "--xds-address", "127.0.0.1:0"}, io.Discard)
	if err != nil || c.XDSHandshakeTimeout != DefaultXDSHandshakeTimeout {
		t.Fatalf("default: %v, %v; want %s", c, err, DefaultXDSHandshakeTimeout)
	}
}
