package app

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"testing"

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
