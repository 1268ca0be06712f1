package dataplane_test

import (
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

// TestDeliverInboundRefusesUnsafeSockets is the identity-theft attack of a
// pod with a csi.aether.io volume: the pod writes its own socket dir, so it
// can replace its socket with a link to the node's agent sockets (one level
// up from <uds-csi-root> in the default layout), with another file, or with
// a hard link. The proxy must never connect anywhere but a socket directly
// in the pod's own dir whose owner matches the dir; each attack is delivered
// over TCP (via="uds_refused"), and the "agent" socket sees no connection.
func TestDeliverInboundRefusesUnsafeSockets(t *testing.T) {
	run := t.TempDir() // /run/aether
	root := filepath.Join(run, "uds")
	agentDir := filepath.Join(run, "agent")
	for _, d := range []string{root, agentDir} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	// The node's private socket: what a thief wants to reach.
	secret := filepath.Join(agentDir, "workload.sock")
	secretLn, err := net.Listen("unix", secret)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = secretLn.Close() })
	stolen := make(chan struct{}, 16)
	go func() {
		for {
			c, err := secretLn.Accept()
			if err != nil {
				return
			}
			stolen <- struct{}{}
			_, _ = io.WriteString(c, "secret")
			_ = c.Close()
		}
	}()

	e := setup(t, dataplane.Config{UDSRoot: root})
	const appPort = 8080
	e.server.Handle(t, appPort, func(c net.Conn) { _, _ = io.WriteString(c, "tcp") })
	server4 := netip.AddrPortFrom(e.server.IP4, appPort)

	const uid = "uid-server"
	dir := filepath.Join(root, uid)
	sock := filepath.Join(dir, "app.sock")
	// serve points the server pod's listeners at path (the agent resolved
	// it) and waits until the pod serves with them.
	serve := func(t *testing.T, path string) {
		t.Helper()
		specs := e.client.Specs(t)
		for _, s := range e.server.Specs(t) {
			s.UID, s.UDSSocket = uid, path
			specs = append(specs, s)
		}
		e.mgr.SetListeners(specs)
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			for _, st := range e.mgr.Status() {
				if st.Key == "ctr-server" && st.UDSSocket == path {
					return true
				}
			}
			return false
		}); err != nil {
			t.Fatalf("the server pod never took UDS socket %q: %v", path, err)
		}
		e.waitReady(t, e.server, 200)
	}
	reset := func(t *testing.T, mode os.FileMode, gid int) {
		t.Helper()
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(dir, 0, gid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, mode); err != nil {
			t.Fatal(err)
		}
	}
	listen := func(t *testing.T, path, reply string) {
		t.Helper()
		ln, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ln.Close() })
		go answer(ln, reply)
	}
	via := func(v string) float64 {
		return sum(e.metrics, "aether_inbound_deliveries_total", map[string]string{"via": v})
	}

	for _, tc := range []struct {
		name string
		// path is the socket the agent names (default sock).
		path    string
		prepare func(t *testing.T)
		want    string
		wantVia string
	}{
		{
			name:    "the app's own socket in a root-owned dir",
			prepare: func(t *testing.T) { reset(t, 0o700, 0); listen(t, sock, "uds") },
			want:    "uds", wantVia: telemetry.ViaUDS,
		},
		{
			name: "a non-root app's socket in a set-group-ID fsGroup dir",
			prepare: func(t *testing.T) {
				reset(t, os.ModeSetgid|0o770, 4321)
				listen(t, sock, "uds")
				// The app runs as 1000 in group 4321: setgid gave the
				// socket the group.
				if err := os.Lchown(sock, 1000, 4321); err != nil {
					t.Fatal(err)
				}
			},
			want: "uds", wantVia: telemetry.ViaUDS,
		},
		{
			name: "socket replaced by a symlink to the agent's socket",
			prepare: func(t *testing.T) {
				reset(t, 0o700, 0)
				if err := os.Symlink("../../agent/workload.sock", sock); err != nil {
					t.Fatal(err)
				}
			},
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name: "socket replaced by an absolute symlink",
			prepare: func(t *testing.T) {
				reset(t, 0o700, 0)
				if err := os.Symlink(secret, sock); err != nil {
					t.Fatal(err)
				}
			},
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name: "the pod dir itself a symlink to the agent's dir",
			prepare: func(t *testing.T) {
				if err := os.RemoveAll(dir); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(agentDir, dir); err != nil {
					t.Fatal(err)
				}
			},
			path: filepath.Join(dir, "workload.sock"),
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name:    "a path that climbs out of the pod's dir",
			prepare: func(t *testing.T) { reset(t, 0o700, 0) },
			path:    dir + "/../../agent/workload.sock",
			want:    "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name:    "the agent's socket named directly",
			prepare: func(t *testing.T) { reset(t, 0o700, 0) },
			path:    secret,
			want:    "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name: "another pod's socket dir",
			prepare: func(t *testing.T) {
				reset(t, 0o700, 0)
				other := filepath.Join(root, "uid-other")
				if err := os.MkdirAll(other, 0o700); err != nil {
					t.Fatal(err)
				}
				listen(t, filepath.Join(other, "app.sock"), "other pod")
			},
			path: filepath.Join(root, "uid-other", "app.sock"),
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name: "a hard link to a socket",
			prepare: func(t *testing.T) {
				reset(t, 0o700, 0)
				elsewhere := filepath.Join(dir, "real.sock")
				listen(t, elsewhere, "linked")
				if err := os.Link(elsewhere, sock); err != nil {
					t.Fatal(err)
				}
			},
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name: "a fifo instead of a socket",
			prepare: func(t *testing.T) {
				reset(t, 0o700, 0)
				if err := syscall.Mkfifo(sock, 0o600); err != nil {
					t.Fatal(err)
				}
			},
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
		{
			name: "a socket of another user in a root-owned dir",
			prepare: func(t *testing.T) {
				reset(t, 0o700, 0)
				listen(t, sock, "uds")
				if err := os.Lchown(sock, 1000, 1000); err != nil {
					t.Fatal(err)
				}
			},
			want: "tcp", wantVia: telemetry.ViaUDSRefused,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.prepare(t)
			path := tc.path
			if path == "" {
				path = sock
			}
			serve(t, path)
			before := via(tc.wantVia)
			c, err := e.mgr.DeliverInbound(ctx10(t), "ctr-server", server4)
			if err != nil {
				t.Fatalf("DeliverInbound: %v; want a delivery (%s)", err, tc.want)
			}
			b, _ := io.ReadAll(c)
			_ = c.Close()
			if string(b) != tc.want {
				t.Errorf("delivered to %q, want %q", b, tc.want)
			}
			if n := via(tc.wantVia) - before; n != 1 {
				t.Errorf("via=%s counted %v times, want 1", tc.wantVia, n)
			}
			select {
			case <-stolen:
				t.Fatal("the proxy connected to the agent's private socket")
			default:
			}
		})
	}
}
