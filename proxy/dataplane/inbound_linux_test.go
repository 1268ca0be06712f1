package dataplane_test

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

// answer serves ln: every connection gets reply and is closed.
func answer(ln net.Listener, reply string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_, _ = io.WriteString(c, reply)
		_ = c.Close()
	}
}

// TestDeliverInbound hands inbound connections to the app: over the pod's
// UDS socket when its listeners name one, over TCP from the pod netns when
// they do not, and over TCP with an ERROR and a counter when the socket is
// missing or refuses — never a dropped connection. A target that is not
// the pod's, or a pod not served, is refused.
func TestDeliverInbound(t *testing.T) {
	root := t.TempDir()
	e := setup(t, dataplane.Config{UDSRoot: root})
	const appPort = 8080
	for _, p := range []*proxytest.Pod{e.client, e.server} {
		p.Handle(t, appPort, func(c net.Conn) { _, _ = io.WriteString(c, "tcp") })
	}
	// The socket is where aether-csi and the agent put it:
	// <uds-csi-root>/<pod uid>/<file>, in a root-owned 0700 dir.
	const serverUID = "uid-server"
	if err := os.Mkdir(filepath.Join(root, serverUID), 0o700); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(root, serverUID, "app.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go answer(ln, "uds")

	// The server pod's record now resolves a UDS socket.
	specs := e.client.Specs(t)
	for _, s := range e.server.Specs(t) {
		s.UID, s.UDSSocket = serverUID, sock
		specs = append(specs, s)
	}
	e.mgr.SetListeners(specs)
	server4 := netip.AddrPortFrom(e.server.IP4, appPort)
	// The changed pod is drained and bound again: wait for its new specs.
	if err := proxytest.WaitFor(ctx10(t), func() bool {
		c, err := e.mgr.DeliverInbound(ctx10(t), "ctr-server", server4)
		if err != nil {
			return false
		}
		defer func() { _ = c.Close() }()
		b, _ := io.ReadAll(c)
		return string(b) == "uds"
	}); err != nil {
		t.Fatalf("the server pod never delivered over its UDS socket: %v", err)
	}
	e.waitReady(t, e.server, 200)
	for _, st := range e.mgr.Status() {
		if want := map[string]string{"ctr-server": sock, "ctr-client": ""}[st.Key]; st.UDSSocket != want {
			t.Errorf("Status of %s: UDSSocket %q, want %q", st.Key, st.UDSSocket, want)
		}
	}

	read := func(key string, target netip.AddrPort) (string, error) {
		t.Helper()
		c, err := e.mgr.DeliverInbound(ctx10(t), key, target)
		if err != nil {
			return "", err
		}
		defer func() { _ = c.Close() }()
		b, err := io.ReadAll(c)
		return string(b), err
	}
	via := func(v string) float64 {
		return sum(e.metrics, "aether_inbound_deliveries_total", map[string]string{"via": v})
	}
	for i, tc := range []struct {
		name, key string
		target    netip.AddrPort
		before    func()
		want      string
		wantVia   string
	}{
		{name: "uds", key: "ctr-server", target: server4, want: "uds", wantVia: telemetry.ViaUDS},
		{name: "no socket declared: tcp (IPv6)", key: "ctr-client", target: netip.AddrPortFrom(e.client.IP6, appPort), want: "tcp", wantVia: telemetry.ViaTCP},
		{
			name: "socket refuses: tcp", key: "ctr-server", target: server4, want: "tcp", wantVia: telemetry.ViaUDSFallback,
			before: func() {
				// A socket file nobody listens on.
				ln.(*net.UnixListener).SetUnlinkOnClose(false)
				_ = ln.Close()
			},
		},
		{
			name: "socket missing: tcp", key: "ctr-server", target: server4, want: "tcp", wantVia: telemetry.ViaUDSFallback,
			before: func() {
				if err := os.Remove(sock); err != nil {
					t.Fatal(err)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.before != nil {
				tc.before()
			}
			before := via(tc.wantVia)
			got, err := read(tc.key, tc.target)
			if err != nil || got != tc.want {
				t.Fatalf("delivery %d = %q, %v; want %q", i, got, err, tc.want)
			}
			if n := via(tc.wantVia) - before; n != 1 {
				t.Errorf("via=%s counted %v times, want 1", tc.wantVia, n)
			}
		})
	}

	failedBefore := via(telemetry.ViaFailed)
	if _, err := read("ctr-server", netip.AddrPortFrom(e.server.IP4, appPort+1)); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("delivery to a closed port = %v, want connection refused", err)
	}
	if via(telemetry.ViaFailed)-failedBefore != 1 {
		t.Error("a failed delivery was not counted via=failed")
	}
	if _, err := read("ctr-server", netip.AddrPortFrom(e.client.IP4, appPort)); !errors.Is(err, dataplane.ErrNotThisPod) {
		t.Errorf("delivery to another pod's address = %v, want ErrNotThisPod", err)
	}
	if _, err := read("ctr-nope", server4); !errors.Is(err, dataplane.ErrNotServing) {
		t.Errorf("delivery to an unknown pod = %v, want ErrNotServing", err)
	}
}
