package demo

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/test/harness"
)

// syncBuffer is a bytes.Buffer safe for a process writing and a test
// reading.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// proc is one daemon started by the demo (aether-agent, aether-proxy).
type proc struct {
	name string
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error
}

// startProc starts bin inside node (its loopback listeners live there) and
// stops it with SIGTERM (SIGKILL after 15 s) in t.Cleanup.
func startProc(t *testing.T, node *harness.NS, name, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	// Own process group, so a Ctrl-C of `make demo` reaches the test first
	// and the test stops its daemons in order.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := node.Do(p.cmd.Start); err != nil {
		t.Fatalf("failed to start %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { p.stop(t) })
	return p
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) stop(t *testing.T) {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		t.Errorf("%s did not stop within 15 s of SIGTERM: killed", p.name)
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// tail returns the last n lines the process wrote.
func (p *proc) tail(n int) string {
	lines := strings.Split(strings.TrimRight(p.out.String(), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// waitAgent waits until the agent serves its CNI socket.
func waitAgent(ctx context.Context, p *proc, sock string) error {
	c, err := agentclient.New(sock, agentclient.Options{Timeout: time.Second, Attempts: 1, ReportTimeout: time.Second})
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	for {
		err := c.Ready(ctx)
		if err == nil {
			return nil
		}
		if p.exited() {
			return fmt.Errorf("aether-agent exited at start (%s):\n%s", errString(p.err), p.tail(20))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("aether-agent not ready on %s: %w\n%s", sock, err, p.tail(20))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// httpIn does one HTTP GET to addr (host:port) from a socket created inside
// n; the rest of the exchange needs no namespace.
func httpIn(n *harness.NS, addr, path string, timeout time.Duration) (int, string, error) {
	var conn net.Conn
	err := n.Do(func() error {
		var err error
		conn, err = net.DialTimeout("tcp", addr, timeout)
		return err
	})
	if err != nil {
		return 0, "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(timeout))
	if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, addr); err != nil {
		return 0, "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// unixHTTP returns an HTTP client of a unix socket (the agent's admin API).
func unixHTTP(sock string) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
}

// adminPod is the part of the agent's admin view (agent/adminapi.Pod) the
// demo checks.
type adminPod struct {
	Namespace   string   `json:"namespace"`
	Name        string   `json:"name"`
	ContainerID string   `json:"container_id"`
	IPs         []string `json:"ips"`
	Managed     bool     `json:"managed"`
	Registered  bool     `json:"registered"`
	Uncaptured  bool     `json:"uncaptured"`
	// UncapturedError says why the divert is missing.
	UncapturedError string            `json:"uncaptured_error"`
	LastTimings     map[string]string `json:"last_timings"`
}

// adminPods lists the agent's records.
func adminPods(sock string) ([]adminPod, error) {
	resp, err := unixHTTP(sock).Get("http://agent/v1/pods")
	if err != nil {
		return nil, fmt.Errorf("failed to query the agent's admin socket %s: %w", sock, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("agent admin GET /v1/pods: %d %s", resp.StatusCode, b)
	}
	var out []adminPod
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("agent admin GET /v1/pods: %w", err)
	}
	return out, nil
}

// writePodManifest writes a Pod manifest into the agent's pod source.
func writePodManifest(dir, node, namespace, name, uid string, managed bool) error {
	labels := map[string]string{"app": name}
	if managed {
		labels["aether.io/managed"] = "true"
	}
	doc := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": namespace, "uid": uid, "labels": labels},
		"spec": map[string]any{
			"nodeName": node, "serviceAccountName": name,
			"containers": []map[string]any{{"name": "app", "image": "demo/" + name + ":1"}},
		},
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, namespace+"_"+name+".json"), b, 0o600)
}

// serviceVIP is the demo Service's ClusterIP and port (no kube-proxy runs:
// only the mesh makes it answer).
var serviceVIP = netip.MustParseAddrPort("10.96.0.10:80")

// writeServiceManifest writes a ClusterIP Service into the agent's manifest
// directory (the agent derives its endpoints from the pods there, as the
// EndpointSlice controller would).
func writeServiceManifest(dir, namespace, name, clusterIP string, port uint16, targetPort int, selector map[string]string) error {
	doc := map[string]any{
		"apiVersion": "v1", "kind": "Service",
		"metadata": map[string]any{"name": name, "namespace": namespace},
		"spec": map[string]any{
			"clusterIP": clusterIP, "clusterIPs": []string{clusterIP}, "selector": selector,
			"ports": []map[string]any{{"name": "tcp-echo", "port": port, "targetPort": targetPort}},
		},
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, namespace+"_svc_"+name+".json"), b, 0o600)
}

// demoPolicy is the demo's AuthorizationPolicy, as Istio's documentation
// writes one: the server accepts only shop/client's service account, and
// only on :8080.
const demoPolicy = `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: server-ingress
  namespace: shop
spec:
  selector:
    matchLabels:
      app: server
  action: ALLOW
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/shop/sa/client"]
    to:
    - operation:
        ports: ["8080"]
`

// Metric is one Prometheus text-format sample.
type Metric struct {
	Name   string
	Labels map[string]string
	Value  float64
}

var (
	sampleRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)`)
	labelRE  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)
)

// parseMetrics parses the samples of a Prometheus text exposition.
func parseMetrics(text string) []Metric {
	var out []Metric
	for _, line := range strings.Split(text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		m := sampleRE.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		v, err := strconv.ParseFloat(m[4], 64)
		if err != nil {
			continue
		}
		s := Metric{Name: m[1], Labels: map[string]string{}, Value: v}
		for _, l := range labelRE.FindAllStringSubmatch(m[3], -1) {
			s.Labels[l[1]] = l[2]
		}
		out = append(out, s)
	}
	return out
}

// sum adds the samples named name whose labels include want.
func sum(ms []Metric, name string, want map[string]string) float64 {
	var total float64
	for _, m := range ms {
		if m.Name != name {
			continue
		}
		ok := true
		for k, v := range want {
			if m.Labels[k] != v {
				ok = false
				break
			}
		}
		if ok {
			total += m.Value
		}
	}
	return total
}

// vlanLink returns the VLAN ID and MAC of link name in n (0 when it is not
// an 802.1Q link or missing).
func vlanLink(n *harness.NS, name string) (int, string) {
	vid, mac := 0, ""
	_ = n.Do(func() error {
		l, err := netlinksafe.LinkByName(name)
		if err != nil {
			return nil
		}
		if v, ok := l.(*netlink.Vlan); ok {
			vid, mac = v.VlanId, l.Attrs().HardwareAddr.String()
		}
		return nil
	})
	return vid, mac
}

// vlanDevices lists the 802.1Q links in n.
func vlanDevices(n *harness.NS) ([]string, error) {
	var out []string
	err := n.Do(func() error {
		ls, err := netlinksafe.LinkList()
		if err != nil {
			return err
		}
		for _, l := range ls {
			if l.Type() == "vlan" {
				out = append(out, l.Attrs().Name)
			}
		}
		return nil
	})
	return out, err
}

// fwmarkRules lists the policy-routing rules with an fwmark in n (the
// capture divert's).
func fwmarkRules(n *harness.NS) ([]string, error) {
	var out []string
	err := n.Do(func() error {
		for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
			rs, err := netlinksafe.RuleList(fam)
			if err != nil {
				return err
			}
			for _, r := range rs {
				if r.Mark != 0 {
					out = append(out, fmt.Sprintf("fwmark %#x lookup %d", r.Mark, r.Table))
				}
			}
		}
		return nil
	})
	return out, err
}

// setSysctls writes /proc/sys values inside n.
func setSysctls(n *harness.NS, kv map[string]string) error {
	keys := make([]string, 0, len(kv))
	for k := range kv {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return n.Do(func() error {
		for _, k := range keys {
			p := "/proc/sys/" + strings.ReplaceAll(k, ".", "/")
			if err := os.WriteFile(p, []byte(kv[k]), 0o644); err != nil {
				return fmt.Errorf("failed to set %s: %w", k, err)
			}
		}
		return nil
	})
}

// fabricVLANLink names the fabric's sub-interface of vlan, as
// enivlantest.Cloud makes it (RealVLAN).
func fabricVLANLink(vlan int) string { return fmt.Sprintf("fv%d", vlan) }

// routeHost adds ip/32 via link in n (the fabric's route to one pod on its
// VLAN sub-interface) and makes the link answer proxy ARP at once (the
// per-device neigh sysctls are the only ones outside the initial netns).
func routeHost(n *harness.NS, ip netip.Addr, link string) error {
	if err := setSysctls(n, map[string]string{"net.ipv4.neigh." + link + ".proxy_delay": "0"}); err != nil {
		return err
	}
	return n.Do(func() error {
		l, err := netlinksafe.LinkByName(link)
		if err != nil {
			return fmt.Errorf("failed to find fabric link %q: %w", link, err)
		}
		dst := &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())}
		if err := netlink.RouteReplace(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK}); err != nil {
			return fmt.Errorf("failed to route %s via %s: %w", dst, link, err)
		}
		return nil
	})
}

// flowCounters are nftables counters on the fabric's forward hook: proof
// that pod-to-pod packets were routed by the fabric.
type flowCounters struct {
	conn  *nftables.Conn
	table *nftables.Table
	chain *nftables.Chain
	flows map[string]uint64 // name -> rule handle
}

func newFlowCounters(n *harness.NS) (*flowCounters, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(n.Fd())))
	if err != nil {
		return nil, fmt.Errorf("failed to open nftables in the fabric: %w", err)
	}
	f := &flowCounters{conn: c, flows: map[string]uint64{}}
	f.table = c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: "demo_flows"})
	f.chain = c.AddChain(&nftables.Chain{
		Name: "forward", Table: f.table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter,
	})
	if err := c.Flush(); err != nil {
		return nil, fmt.Errorf("failed to add the fabric's flow counters: %w", err)
	}
	return f, nil
}

// add counts TCP packets from src to dst:port (and the replies under
// name+"/reply").
func (f *flowCounters) add(name string, src, dst netip.Addr, port uint16) error {
	p := make([]byte, 2)
	binary.BigEndian.PutUint16(p, port)
	rule := func(s, d netip.Addr, portOff uint32) []expr.Any {
		sa, da := s.As4(), d.As4()
		return []expr.Any{
			&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: sa[:]},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: da[:]},
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: portOff, Len: 2},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p},
			&expr.Counter{},
		}
	}
	f.conn.AddRule(&nftables.Rule{Table: f.table, Chain: f.chain, Exprs: rule(src, dst, 2), UserData: []byte(name)})
	f.conn.AddRule(&nftables.Rule{Table: f.table, Chain: f.chain, Exprs: rule(dst, src, 0), UserData: []byte(name + "/reply")})
	return f.conn.Flush()
}

// packets returns the packets counted per flow name.
func (f *flowCounters) packets() (map[string]uint64, error) {
	rules, err := f.conn.GetRules(f.table, f.chain)
	if err != nil {
		return nil, fmt.Errorf("failed to read the fabric's flow counters: %w", err)
	}
	out := map[string]uint64{}
	for _, r := range rules {
		for _, e := range r.Exprs {
			if c, ok := e.(*expr.Counter); ok {
				out[string(r.UserData)] = c.Packets
			}
		}
	}
	return out, nil
}

// echoServer is the server pod's application: a TCP server on :8080 in the
// pod's netns that answers each line with who it saw.
type echoServer struct {
	ln    net.Listener
	mu    sync.Mutex
	peers []netip.Addr
}

func startEcho(t *testing.T, n *harness.NS, port int) (*echoServer, error) {
	s := &echoServer{}
	err := n.Do(func() error {
		var err error
		s.ln, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("failed to listen in the server pod: %w", err)
	}
	t.Cleanup(func() { _ = s.ln.Close() })
	go func() {
		for {
			c, err := s.ln.Accept()
			if err != nil {
				return
			}
			ap, _ := netip.ParseAddrPort(c.RemoteAddr().String())
			s.mu.Lock()
			s.peers = append(s.peers, ap.Addr().Unmap())
			s.mu.Unlock()
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					return
				}
				fmt.Fprintf(c, "server saw %s say %q\n", ap.Addr().Unmap(), strings.TrimSpace(line))
			}()
		}
	}()
	return s, nil
}

func (s *echoServer) seen() []netip.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]netip.Addr(nil), s.peers...)
}

// talk connects from a socket made inside n to dst, sends msg and returns
// the answer line.
func talk(n *harness.NS, dst netip.AddrPort, msg string) (string, error) {
	var conn net.Conn
	err := n.Do(func() error {
		var err error
		conn, err = net.DialTimeout("tcp", dst.String(), 5*time.Second)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("failed to connect to %s: %w", dst, err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintln(conn, msg); err != nil {
		return "", fmt.Errorf("failed to send to %s: %w", dst, err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("no answer from %s: %w", dst, err)
	}
	return strings.TrimSpace(line), nil
}

// cniCode returns the CNI error code of err (0 when it is not a CNI error).
func cniCode(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

var validationRE = regexp.MustCompile(`validation=("(?:[^"\\]|\\.)*"|\S+)`)

// preflightFromLog returns the validation field of eni-vlan's "ADD done"
// log line in file.
func preflightFromLog(file string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.Contains(line, `msg="ADD done"`) {
			continue
		}
		if m := validationRE.FindStringSubmatch(line); m != nil {
			v := m[1]
			if u, err := strconv.Unquote(v); err == nil {
				v = u
			}
			return strings.TrimSuffix(strings.TrimPrefix(v, "map["), "]")
		}
	}
	return ""
}

// mounts returns the mount points under dir.
func mounts(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			out = append(out, f[4])
		}
	}
	return out
}
