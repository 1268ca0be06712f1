// Package proxytest (Linux only) builds the namespaces aether-proxy's integration tests
// and benchmarks run in: a node netns holding a bridge, and pod netns joined
// to it by veths, with the capture divert of pkg/capture installed in the
// pods that are captured, plus small TCP helpers that run inside a pod.
// NewCluster builds several such nodes routed to each other over a fabric
// bridge, each with its own pod subnets.
package proxytest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"aether.io/node/api/istio/workload"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/test/harness"
	"aether.io/node/xds/listener"
)

// Pod is one pod netns of a topology.
type Pod struct {
	NS   *harness.NS
	Name string
	IP4  netip.Addr
	IP6  netip.Addr
	// SPIFFEID, when set, is put in the pod's listeners (the agent does
	// when it serves identities): the proxy then serves HBONE for it.
	SPIFFEID string
}

// Record is the pod record the agent would build listeners from.
func (p *Pod) Record() listener.Pod {
	return listener.Pod{
		ContainerID: "ctr-" + p.Name, Namespace: "default", Name: p.Name, UID: "uid-" + p.Name,
		NetNSPath: p.NS.Path(), IPs: []netip.Addr{p.IP4, p.IP6}, SPIFFEID: p.SPIFFEID,
	}
}

// Workload is the WDS resource the agent would serve for the pod.
func (p *Pod) Workload() *workload.Workload {
	return &workload.Workload{
		Uid: "Kubernetes//Pod/default/" + p.Name, Name: p.Name, Namespace: "default",
		WorkloadName: p.Name, CanonicalName: p.Name + "-svc",
		Addresses: [][]byte{p.IP4.AsSlice(), p.IP6.AsSlice()},
	}
}

// Specs are the parsed listeners of the pod.
func (p *Pod) Specs(tb testing.TB) []listener.Spec {
	tb.Helper()
	ls, err := listener.Build(p.Record())
	if err != nil {
		tb.Fatal(err)
	}
	var out []listener.Spec
	for _, l := range ls {
		s, err := listener.Parse(l)
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// Topology is a node netns with a bridge and pods on it (10.88.0.0/24,
// fd88::/64).
type Topology struct {
	Node *harness.NS
	Pods []*Pod
}

// New creates the node and one pod per name; pods listed in captured get
// the divert (redirect-all, defaults) installed with pkg/capture.
func New(tb testing.TB, names []string, captured ...string) *Topology {
	tb.Helper()
	t := &Topology{Node: harness.NewNS(tb, "node")}
	harness.Bridge(tb, t.Node, "br0")
	t.addPods(tb, 0, names, captured)
	return t
}

// addPods creates one pod per name on the node's bridge br0, in the
// subnets of node index node (10.88.<node>.0/24, fd88:0:0:<node>::/64,
// pods from .2 on); pods listed in captured get the divert.
func (t *Topology) addPods(tb testing.TB, node int, names, captured []string) {
	tb.Helper()
	for i, name := range names {
		ns := harness.NewNS(tb, "pod")
		ns.MustDo(tb, func() error {
			return os.WriteFile("/proc/sys/net/ipv6/conf/default/accept_dad", []byte("0"), 0o644)
		})
		p := &Pod{
			NS: ns, Name: name,
			IP4: netip.AddrFrom4([4]byte{10, 88, byte(node), byte(i + 2)}),
			IP6: netip.MustParseAddr(fmt.Sprintf("fd88:0:0:%x::%d", node, i+2)),
		}
		host := fmt.Sprintf("veth%d", i)
		harness.Veth(tb, ns, "eth0", t.Node, host)
		harness.Enslave(tb, t.Node, host, "br0")
		harness.AddAddr(tb, ns, "eth0", p.IP4.String()+"/24")
		harness.AddAddr(tb, ns, "eth0", p.IP6.String()+"/64")
		if slices.Contains(captured, name) {
			installDivert(tb, ns, name)
		}
		t.Pods = append(t.Pods, p)
	}
}

// Dial connects from inside the pod to dst.
func (p *Pod) Dial(ctx context.Context, dst netip.AddrPort) (*net.TCPConn, error) {
	var c net.Conn
	err := p.NS.Do(func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, "tcp", dst.String())
		return err
	})
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// Readiness GETs the readiness endpoint from inside the pod and returns the
// HTTP status code.
func (p *Pod) Readiness(ctx context.Context) (int, error) {
	c, err := p.Dial(ctx, netip.MustParseAddrPort(fmt.Sprintf("127.0.0.1:%d", listener.DefaultOutboundPort)))
	if err != nil {
		return 0, err
	}
	defer func() { _ = c.Close() }()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n", listener.ReadyPath); err != nil {
		return 0, err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return 0, err
	}
	var code int
	if _, err := fmt.Sscanf(strings.TrimSpace(line), "HTTP/1.%d %d", new(int), &code); err != nil {
		return 0, fmt.Errorf("bad status line %q: %w", line, err)
	}
	return code, nil
}

// ReadyCode is Readiness with a one-second bound per try; 0 when the
// endpoint did not answer.
func (p *Pod) ReadyCode(ctx context.Context) int {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	code, err := p.Readiness(ctx)
	if err != nil {
		return 0
	}
	return code
}

// Server is a TCP server inside a pod: for each connection it reads until
// EOF, then answers "got <n> from <remote ip>" and closes.
type Server struct {
	// Got receives one line per finished connection: "<remote ip> <payload>".
	Got chan string
}

// Handle serves port on both of the pod's addresses, running handle on
// its own goroutine for each connection (closed afterwards).
func (p *Pod) Handle(tb testing.TB, port uint16, handle func(net.Conn)) {
	tb.Helper()
	for _, a := range []netip.Addr{p.IP4, p.IP6} {
		ln := p.listen(tb, netip.AddrPortFrom(a, port))
		tb.Cleanup(func() { _ = ln.Close() })
		go serveConns(ln, handle)
	}
}

// ServeUnix runs handle for every connection to a unix socket at path (an
// app's UDS socket, outside any pod netns), each on its own goroutine
// (closed afterwards); the listener closes at the end of the test, and
// closing it earlier (the returned listener) removes the socket file.
func ServeUnix(tb testing.TB, path string, handle func(net.Conn)) net.Listener {
	tb.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = ln.Close() })
	go serveConns(ln, handle)
	return ln
}

// serveConns accepts on ln until it closes, handling each connection on
// its own goroutine and closing it afterwards.
func serveConns(ln net.Listener, handle func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer func() { _ = c.Close() }()
			handle(c)
		}()
	}
}

// Serve starts the server on port for both families in the pod.
func (p *Pod) Serve(tb testing.TB, port uint16) *Server {
	tb.Helper()
	s := &Server{Got: make(chan string, 64)}
	p.Handle(tb, port, func(c net.Conn) {
		b, _ := io.ReadAll(c)
		ra := c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
		_, _ = fmt.Fprintf(c, "got %d from %s", len(b), ra)
		s.Got <- ra.String() + " " + string(b)
	})
	return s
}

// Echo starts a server that echoes every byte back, on port for both
// families.
func (p *Pod) Echo(tb testing.TB, port uint16) {
	tb.Helper()
	p.Handle(tb, port, func(c net.Conn) { _, _ = io.Copy(c, c) })
}

// listen listens on addr inside the pod, retrying while a fresh IPv6
// address is still tentative (the link's carrier comes up asynchronously).
func (p *Pod) listen(tb testing.TB, addr netip.AddrPort) net.Listener {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var ln net.Listener
	var lastErr error
	_ = WaitFor(ctx, func() bool {
		lastErr = p.NS.Do(func() error {
			var err error
			ln, err = net.Listen("tcp", addr.String())
			return err
		})
		return lastErr == nil
	})
	if ln == nil {
		tb.Fatalf("failed to listen on %s in %s: %v", addr, p.Name, lastErr)
	}
	return ln
}

// WaitFor polls cond every 20 ms until it holds or ctx ends.
func WaitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// PodSocketPath makes the pod socket dir <root>/<uid>/ as aether-csi does
// for a pod without fsGroup (root-owned, meshcontract.PodDirMode) and
// returns <root>/<uid>/<file>, the path the agent would resolve.
func PodSocketPath(tb testing.TB, root, uid, file string) string {
	tb.Helper()
	dir := meshcontract.PodSocketDir(root, uid)
	if err := os.MkdirAll(dir, meshcontract.PodDirMode); err != nil {
		tb.Fatal(err)
	}
	return filepath.Join(dir, file)
}
