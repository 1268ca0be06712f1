package enivlan_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	cniversion "github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/mdlayher/arp"
	"github.com/vishvananda/netlink"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/link"
	"aether.io/node/enivlan/preflight"
	"aether.io/node/enivlan/spiderpool"
	"aether.io/node/pkg/cniutil"
	"aether.io/node/test/harness"
)

// fakeIPAM is the IPAM delegate: ADD answers result (or addErr), DEL
// counts releases (and fails with delErr).
type fakeIPAM struct {
	mu            sync.Mutex
	result        string
	addErr        error
	delErr        error
	adds, deletes int
}

func (f *fakeIPAM) ExecPlugin(_ context.Context, _ string, _ []byte, environ []string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	cmd := ""
	for _, e := range environ {
		if v, ok := strings.CutPrefix(e, "CNI_COMMAND="); ok {
			cmd = v
		}
	}
	switch cmd {
	case "ADD":
		f.adds++
		if f.addErr != nil {
			return nil, f.addErr
		}
		return []byte(f.result), nil
	case "DEL":
		f.deletes++
		return nil, f.delErr
	}
	return nil, nil
}

func (f *fakeIPAM) FindInPath(plugin string, _ []string) (string, error) {
	return "/fake/" + plugin, nil
}

func (f *fakeIPAM) Decode(b []byte) (cniversion.PluginInfo, error) {
	return (&cniversion.PluginDecoder{}).Decode(b)
}

// fakeEndpoints is spiderpool-agent.
type fakeEndpoints struct {
	binding   *spiderpool.Binding
	lookupErr error
	get       *spiderpool.WorkloadEndpointStatus
	getErr    error
	lookups   int
	closed    int
}

func (f *fakeEndpoints) Lookup(context.Context, spiderpool.Query) (*spiderpool.Binding, error) {
	f.lookups++
	return f.binding, f.lookupErr
}

func (f *fakeEndpoints) Get(context.Context, string, string) (*spiderpool.WorkloadEndpointStatus, error) {
	return f.get, f.getErr
}

func (f *fakeEndpoints) Healthy(context.Context) error { return nil }
func (f *fakeEndpoints) Close()                        { f.closed++ }

// fakeProber answers the pre-flight with reply (an ARP payload matched by
// the real preflight.MatchARPReply: no match is no reply), or fails with
// err.
type fakeProber struct {
	gwMAC     net.HardwareAddr
	wrongMAC  bool // reply to another MAC than the link's
	err       error
	probes    int
	announced []netip.Addr
	closed    int
}

func (f *fakeProber) Probe(_ context.Context, s preflight.Spec) (preflight.Result, error) {
	f.probes++
	if f.err != nil {
		return preflight.Result{}, f.err
	}
	to := s.MAC
	if f.wrongMAC {
		to = net.HardwareAddr{0x02, 0, 0, 0, 0xde, 0xad}
	}
	p, err := arp.NewPacket(arp.OperationReply, f.gwMAC, s.Gateway, to, s.IP)
	if err != nil {
		return preflight.Result{}, err
	}
	b, err := p.MarshalBinary()
	if err != nil {
		return preflight.Result{}, err
	}
	if !preflight.MatchARPReply(b, s.Gateway, s.IP, s.MAC) {
		return preflight.Result{}, &preflight.NoReplyError{Spec: s, Family: "arp"}
	}
	return preflight.Result{Attempts: 1, RTT: time.Millisecond, GatewayMAC: f.gwMAC}, nil
}

func (f *fakeProber) Announce(_ net.HardwareAddr, ip netip.Addr) error {
	f.announced = append(f.announced, ip)
	return nil
}

func (f *fakeProber) Close() error { f.closed++; return nil }

// fakeLinker creates the pod link as a bridge macvlan on the master (this
// kernel has no 802.1Q) or fails with err.
type fakeLinker struct{ err error }

func (fakeLinker) Kind() string    { return "dummy-fake" }
func (fakeLinker) Surrogate() bool { return true }
func (d fakeLinker) Add(s link.Spec) error {
	if d.err != nil {
		return d.err
	}
	return netlink.LinkAdd(&netlink.Macvlan{Mode: netlink.MACVLAN_MODE_BRIDGE, LinkAttrs: netlink.LinkAttrs{
		Name: s.TempName, ParentIndex: s.MasterIndex, HardwareAddr: s.MAC, MTU: s.MTU, Namespace: netlink.NsFd(int(s.PodNS.Fd())),
	}})
}
func (fakeLinker) Alias(vlan int) string          { return fmt.Sprintf("fake-vlan=%d", vlan) }
func (fakeLinker) Verify(netlink.Link, int) error { return nil }

const ipamResult = `{"cniVersion":"1.0.0","ips":[{"address":"10.9.0.5/24","gateway":"10.9.0.1"}],"routes":[{"dst":"0.0.0.0/0"}]}`

// unit is one ADD against fakes: a node netns holding the master (a veth
// to fabric0), a pod
// netns, a state dir.
type unit struct {
	node, pod *harness.NS
	stateDir  string
	ipam      *fakeIPAM
	ep        *fakeEndpoints
	prober    *fakeProber
	opened    int
	// prepared counts PrepareCloser calls; ipamAddsAtPrepare and
	// lookupsAtPrepare are how many IPAM ADDs and agent lookups had run at
	// the first one.
	prepared, ipamAddsAtPrepare, lookupsAtPrepare int
	// waited counts WaitCloser calls; closedAtWait is how many times the
	// prober was closed at the first one (its sockets handed over).
	waited, closedAtWait int
	p                    *enivlan.Plugin
	out                  bytes.Buffer
}

func newUnit(t *testing.T) *unit {
	t.Helper()
	u := &unit{
		node: harness.NewNS(t, "node"), pod: harness.NewNS(t, "pod"), stateDir: t.TempDir(),
		ipam:   &fakeIPAM{result: ipamResult},
		ep:     &fakeEndpoints{binding: &spiderpool.Binding{VLAN: 100, MAC: net.HardwareAddr{0x02, 0x42, 0, 0, 0, 0x64}}},
		prober: &fakeProber{gwMAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 1}},
	}
	u.node.MustDo(t, func() error {
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ens5", MTU: 1500}, PeerName: "fabric0"})
	})
	u.p = &enivlan.Plugin{
		Linker:         fakeLinker{},
		DialSpiderpool: func(string) enivlan.Endpoints { return u.ep },
		OpenPreflight:  func(*net.Interface) enivlan.Prober { u.opened++; return u.prober },
		PrepareCloser: func() {
			if u.prepared == 0 {
				u.ipamAddsAtPrepare, u.lookupsAtPrepare = u.ipam.adds, u.ep.lookups
			}
			u.prepared++
		},
		WaitCloser: func() error {
			if u.waited == 0 {
				u.closedAtWait = u.prober.closed
			}
			u.waited++
			return nil
		},
		Log:    slog.New(slog.DiscardHandler),
		Stdout: &u.out,
		Exec:   u.ipam,
	}
	return u
}

func (u *unit) conf(validate bool) []byte {
	b, _ := json.Marshal(map[string]any{
		"cniVersion": "1.0.0", "name": "eni", "type": "eni-vlan", "master": "ens5",
		"validateIaasNetConfig": validate, "validationRetries": 1, "validationTimeoutMs": 1,
		"stateDir": u.stateDir, "spiderpoolSocket": "/nonexistent/spiderpool.sock",
		"ipam": map[string]any{"type": "fake-ipam"},
	})
	return b
}

// add runs ADD (through the CNI-code boundary) from inside the node netns.
func (u *unit) add(t *testing.T, validate bool) error {
	t.Helper()
	a := &skel.CmdArgs{
		ContainerID: "c0ffee", Netns: u.pod.Path(), IfName: "eth1",
		Args: "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=uid-1", StdinData: u.conf(validate),
	}
	var err error
	if derr := u.node.Do(func() error { err = cniutil.Funcs(u.p.Verbs()).Add(a); return nil }); derr != nil {
		t.Fatal(derr)
	}
	return err
}

func podLinks(t *testing.T, n *harness.NS) []string {
	t.Helper()
	var names []string
	n.MustDo(t, func() error {
		ls, err := netlinksafe.LinkList()
		for _, l := range ls {
			if l.Attrs().Name != "lo" {
				names = append(names, l.Attrs().Name)
			}
		}
		return err
	})
	return names
}

func records(t *testing.T, dir string) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	return m
}

// recordFiles lists the record files an ADD prepares before it knows the
// pair; none may be left once ADD returns.
func recordFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(dir, "*.tmp"))
	return m
}

// TestAddFailsClosed drives every failure branch of ADD with fakes and
// checks the CNI code, the message and that every undo ran exactly once:
// IPAM released (if it allocated), no pod link, no ownership record, the
// pre-flight sockets and the agent client closed.
func TestAddFailsClosed(t *testing.T) {
	unavailable := &spiderpool.LookupError{Attempts: 7, Last: errors.New("dial unix /run/spiderpool.sock: connect: connection refused"), Retryable: true, Budget: context.DeadlineExceeded}
	invalid := &spiderpool.LookupError{Attempts: 1, Last: errors.New("spiderpool-agent answered 422"), Retryable: false}
	tests := []struct {
		name     string
		validate bool
		setup    func(t *testing.T, u *unit)
		code     uint
		msg      []string
		ipamDels int
		probes   int
	}{
		{
			name: "IPAM fails", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.ipam.addErr = errors.New("pool exhausted") },
			code:     types.ErrInternal,
			msg:      []string{`failed to allocate addresses with IPAM "fake-ipam"`, "pool exhausted"},
			ipamDels: 0,
		},
		{
			name: "IPAM returns no IP", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.ipam.result = `{"cniVersion":"1.0.0"}` },
			code:     types.ErrInternal,
			msg:      []string{"the result has no IPs"},
			ipamDels: 1,
		},
		{
			name: "spiderpool-agent unavailable", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.ep.binding, u.ep.lookupErr = nil, unavailable },
			code:     types.ErrTryAgainLater,
			msg:      []string{`failed to get the cloud binding of pod default/web-0 interface "eth1" from spiderpool-agent within 20s`, "connection refused"},
			ipamDels: 1,
		},
		{
			name: "spiderpool-agent answer invalid", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.ep.binding, u.ep.lookupErr = nil, invalid },
			code:     types.ErrInternal,
			msg:      []string{`failed to get the cloud binding of pod default/web-0 interface "eth1" from spiderpool-agent: `, "422"},
			ipamDels: 1,
		},
		{
			name: "link creation fails", validate: true,
			setup: func(_ *testing.T, u *unit) {
				u.p.Linker = fakeLinker{err: errors.New("failed to add VLAN link: operation not supported")}
			},
			code:     types.ErrInternal,
			msg:      []string{"operation not supported"},
			ipamDels: 1,
		},
		{
			name: "VLAN held by an unknown device", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.p.Linker = fakeLinker{err: link.ErrVLANExists} },
			code:     types.ErrInternal,
			msg:      []string{`VLAN 100 on master "ens5" is already held by a device eni-vlan has no record of`},
			ipamDels: 1,
		},
		{
			name: "ownership record not writable", validate: true,
			setup: func(t *testing.T, u *unit) {
				// The attachment's record file cannot be created.
				if err := os.MkdirAll(filepath.Join(u.stateDir, "c0ffee.eth1.tmp"), 0o700); err != nil {
					t.Fatal(err)
				}
			},
			code:     types.ErrInternal,
			msg:      []string{`failed to write ownership record`},
			ipamDels: 1,
		},
		{
			name: "VLAN held by a live pod", validate: true,
			setup: func(t *testing.T, u *unit) {
				holder := harness.NewNS(t, "holder")
				mac := u.ep.binding.MAC
				holder.MustDo(t, func() error {
					return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth1", HardwareAddr: mac}, PeerName: "peer0"})
				})
				rec := map[string]any{"master": "ens5", "vlan": 100, "mac": mac.String(), "containerID": "other", "netns": holder.Path(), "ifName": "eth1", "podNamespace": "default", "podName": "db-0"}
				b, _ := json.Marshal(rec)
				if err := os.WriteFile(filepath.Join(u.stateDir, "ens5.100.json"), b, 0o600); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = os.Remove(filepath.Join(u.stateDir, "ens5.100.json")) })
				u.ep.getErr = errors.New("agent busy") // no verdict: the holder counts as alive
			},
			code:     types.ErrTryAgainLater,
			msg:      []string{`VLAN 100 on master "ens5" is in use by pod default/db-0`},
			ipamDels: 1,
		},
		{
			name: "pre-flight gets no reply", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.prober.err = &preflight.NoReplyError{Family: "arp"} },
			code:     types.ErrTryAgainLater,
			msg:      []string{"cloud binding not effective: no reply from gateway 10.9.0.1 to IP 10.9.0.5 on VLAN 100 with MAC 02:42:00:00:00:64 after 1 attempt(s) of 1ms", "IPAM released and link deleted"},
			ipamDels: 1, probes: 1,
		},
		{
			name: "pre-flight gets a reply for another MAC", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.prober.wrongMAC = true },
			code:     types.ErrTryAgainLater,
			msg:      []string{"cloud binding not effective: no reply from gateway 10.9.0.1"},
			ipamDels: 1, probes: 1,
		},
		{
			name: "pre-flight socket fails", validate: true,
			setup:    func(_ *testing.T, u *unit) { u.prober.err = errors.New("failed to open arp socket: permission denied") },
			code:     types.ErrInternal,
			msg:      []string{"failed to validate the cloud binding (IP 10.9.0.5, VLAN 100, MAC 02:42:00:00:00:64, gateway 10.9.0.1)", "permission denied"},
			ipamDels: 1, probes: 1,
		},
		{
			name: "route fails", validate: false,
			setup: func(_ *testing.T, u *unit) {
				u.ipam.result = `{"cniVersion":"1.0.0","ips":[{"address":"10.9.0.5/24","gateway":"10.9.0.1"}],"routes":[{"dst":"0.0.0.0/0","gw":"192.0.2.1"}]}`
			},
			code:     types.ErrInternal,
			msg:      []string{`failed to add route 0.0.0.0/0 via 192.0.2.1 on "eth1"`},
			ipamDels: 1,
		},
		{
			name: "undo fails too", validate: true,
			setup: func(_ *testing.T, u *unit) {
				u.prober.err = &preflight.NoReplyError{Family: "arp"}
				u.ipam.delErr = errors.New("ipam store locked")
			},
			code:     types.ErrTryAgainLater,
			msg:      []string{"cloud binding not effective", "(and releasing IPAM failed: ", "ipam store locked"},
			ipamDels: 1, probes: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := newUnit(t)
			tt.setup(t, u)
			err := u.add(t, tt.validate)
			var te *types.Error
			if !errors.As(err, &te) {
				t.Fatalf("ADD = %v, want a *types.Error", err)
			}
			if te.Code != tt.code {
				t.Errorf("code = %d, want %d (%s)", te.Code, tt.code, te.Msg)
			}
			for _, m := range tt.msg {
				if !strings.Contains(te.Msg, m) {
					t.Errorf("message %q lacks %q", te.Msg, m)
				}
			}
			if u.ipam.deletes != tt.ipamDels {
				t.Errorf("IPAM DEL ran %d times, want %d", u.ipam.deletes, tt.ipamDels)
			}
			if u.out.Len() != 0 {
				t.Errorf("failed ADD printed %q", u.out.String())
			}
			if l := podLinks(t, u.pod); len(l) != 0 {
				t.Errorf("pod netns still has %v", l)
			}
			if l := podLinks(t, u.node); len(l) != 2 {
				t.Errorf("node netns has %v, want only the master and its peer", l)
			}
			if r := records(t, u.stateDir); len(r) != 0 && tt.name != "VLAN held by a live pod" {
				t.Errorf("ownership records left: %v", r)
			}
			if r := recordFiles(t, u.stateDir); len(r) != 0 && tt.name != "ownership record not writable" {
				t.Errorf("record files left: %v", r)
			}
			if u.prober.probes != tt.probes {
				t.Errorf("pre-flight probed %d times, want %d", u.prober.probes, tt.probes)
			}
			if u.prober.closed != u.opened {
				t.Errorf("pre-flight opened %d times, closed %d", u.opened, u.prober.closed)
			}
			if len(u.prober.announced) != 0 {
				t.Errorf("failed ADD announced %v", u.prober.announced)
			}
			if u.ep.lookups > 0 && u.ep.closed != 1 {
				t.Errorf("spiderpool client closed %d times, want 1", u.ep.closed)
			}
		})
	}
}

// TestAddSteps checks the success path with fakes, with and without the
// pre-flight: the link is renamed and configured, the record written, the
// addresses announced on the pre-flight's sockets, which are then closed.
func TestAddSteps(t *testing.T) {
	for _, validate := range []bool{true, false} {
		t.Run(map[bool]string{true: "validation on", false: "validation off"}[validate], func(t *testing.T) {
			u := newUnit(t)
			if err := u.add(t, validate); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			var res map[string]any
			if err := json.Unmarshal(u.out.Bytes(), &res); err != nil {
				t.Fatalf("result %q: %v", u.out.String(), err)
			}
			val, _ := res[enivlan.ValidationKey].(map[string]any)
			wantV4 := "disabled"
			if validate {
				wantV4 = "ok: gateway 10.9.0.1 answered attempt 1 in 1ms"
			}
			if val["ipv4"] != wantV4 {
				t.Errorf("validation = %v, want ipv4 %q", val, wantV4)
			}
			if l := podLinks(t, u.pod); len(l) != 1 || l[0] != "eth1" {
				t.Errorf("pod links = %v, want [eth1]", l)
			}
			// The rename carried the Linker's alias, and (validation on)
			// the link came up with it; off, configure set it up after the
			// addresses.
			u.pod.MustDo(t, func() error {
				l, err := netlinksafe.LinkByName("eth1")
				if err != nil {
					return err
				}
				if l.Attrs().Alias != "fake-vlan=100" || l.Attrs().Flags&net.FlagUp == 0 {
					t.Errorf("eth1: alias %q, flags %v; want alias \"fake-vlan=100\", up", l.Attrs().Alias, l.Attrs().Flags)
				}
				// The result describes the live link.
				ifs, _ := res["interfaces"].([]any)
				var got map[string]any
				if len(ifs) == 1 {
					got, _ = ifs[0].(map[string]any)
				}
				if got["mac"] != l.Attrs().HardwareAddr.String() || got["mtu"] != float64(l.Attrs().MTU) {
					t.Errorf("result interface %v, live link MAC %s MTU %d", got, l.Attrs().HardwareAddr, l.Attrs().MTU)
				}
				return nil
			})
			if r := records(t, u.stateDir); len(r) != 1 || filepath.Base(r[0]) != "ens5.100.json" {
				t.Errorf("records = %v, want ens5.100.json", r)
			}
			if r := recordFiles(t, u.stateDir); len(r) != 0 {
				t.Errorf("record files left: %v", r)
			}
			if u.ipam.deletes != 0 {
				t.Errorf("IPAM DEL ran %d times on success", u.ipam.deletes)
			}
			wantAnnounce, wantOpen := 0, 0
			if validate {
				wantAnnounce, wantOpen = 1, 1
			}
			if len(u.prober.announced) != wantAnnounce || u.opened != wantOpen || u.prober.closed != wantOpen {
				t.Errorf("announced %v, opened %d, closed %d; want %d announcement(s), %d open/close", u.prober.announced, u.opened, u.prober.closed, wantAnnounce, wantOpen)
			}
			// The closer is prepared once, before IPAM ADD (its start
			// overlaps the wait for the delegate, not the wait for the
			// agent, whose answer it would compete with), only when the
			// pre-flight will need it.
			if u.prepared != wantOpen || (validate && (u.ipamAddsAtPrepare != 0 || u.lookupsAtPrepare != 0)) {
				t.Errorf("PrepareCloser ran %d times (after %d IPAM ADDs, %d lookups); want %d, before the IPAM ADD", u.prepared, u.ipamAddsAtPrepare, u.lookupsAtPrepare, wantOpen)
			}
			// ADD waits for the closer it prepared, after the pre-flight's
			// sockets were handed over, so they never go back to this
			// process's exit.
			if u.waited != wantOpen || u.closedAtWait != wantOpen {
				t.Errorf("WaitCloser ran %d times (prober closed %d times at the first); want %d, after the close", u.waited, u.closedAtWait, wantOpen)
			}
		})
	}
}

// TestAddRenameFailsClosed: when the rename to CNI_IFNAME fails (a link of
// that name is already in the pod netns), the undo finds the new link by
// its index and deletes it; IPAM is released and no record is left.
func TestAddRenameFailsClosed(t *testing.T) {
	u := newUnit(t)
	u.pod.MustDo(t, func() error {
		return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth1"}, PeerName: "eth1peer"})
	})
	err := u.add(t, true)
	if err == nil || !strings.Contains(err.Error(), `to "eth1"`) {
		t.Fatalf("ADD = %v, want a failed rename to eth1", err)
	}
	if l := podLinks(t, u.pod); len(l) != 2 || !slices.Contains(l, "eth1") || !slices.Contains(l, "eth1peer") {
		t.Errorf("pod links = %v, want only the veth pair that held the name", l)
	}
	if u.ipam.deletes != 1 {
		t.Errorf("IPAM DEL ran %d times, want 1", u.ipam.deletes)
	}
	if r := records(t, u.stateDir); len(r) != 0 {
		t.Errorf("ownership records left: %v", r)
	}
}

// TestAddKeepsOwnRecord: a retried ADD whose earlier attempt left its
// record (no DEL in between) and whose link cannot be created keeps that
// record: it describes a device that may still exist. Without a record the
// new one is written while the link is created, and dropped if that fails
// (TestAddFailsClosed, "VLAN held by an unknown device").
func TestAddKeepsOwnRecord(t *testing.T) {
	u := newUnit(t)
	own := `{"master":"ens5","vlan":100,"mac":"02:42:00:00:00:64","containerID":"c0ffee","netns":"` + u.pod.Path() + `","ifName":"eth1","podNamespace":"default","podName":"web-0","podUID":"uid-1"}`
	path := filepath.Join(u.stateDir, "ens5.100.json")
	if err := os.WriteFile(path, []byte(own), 0o600); err != nil {
		t.Fatal(err)
	}
	u.p.Linker = fakeLinker{err: link.ErrVLANExists}
	if err := u.add(t, true); err == nil {
		t.Fatal("ADD succeeded with a failing link")
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != own {
		t.Errorf("own record = %q, %v; want it kept as it was", b, err)
	}
	if r := recordFiles(t, u.stateDir); len(r) != 0 {
		t.Errorf("record files left: %v", r)
	}
	if u.ipam.deletes != 1 {
		t.Errorf("IPAM DEL ran %d times, want 1", u.ipam.deletes)
	}
}

// TestAddBadArgs checks the parse step: codes 4 and 7 before anything is
// allocated.
func TestAddBadArgs(t *testing.T) {
	u := newUnit(t)
	a := &skel.CmdArgs{ContainerID: "c", Netns: u.pod.Path(), IfName: "eth1", Args: "K8S_POD_NAME=x", StdinData: u.conf(true)}
	err := cniutil.AsCNIError(u.p.Add(a))
	if err == nil || err.Code != types.ErrInvalidEnvironmentVariables {
		t.Errorf("ADD without namespace = %v, want code 4", err)
	}
	if u.ipam.adds != 0 {
		t.Errorf("IPAM ADD ran %d times", u.ipam.adds)
	}
}

// TestDelRemovesRecordFile: the record file an ADD prepares (and leaves
// only if it dies before committing it) goes with the attachment's DEL;
// another attachment's stays.
func TestDelRemovesRecordFile(t *testing.T) {
	u := newUnit(t)
	mine, other := filepath.Join(u.stateDir, "c0ffee.eth1.tmp"), filepath.Join(u.stateDir, "c0ffee.eth2.tmp")
	for _, p := range []string{mine, other} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	a := &skel.CmdArgs{ContainerID: "c0ffee", IfName: "eth1", Args: "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0", StdinData: u.conf(true)}
	if err := cniutil.Funcs(u.p.Verbs()).Del(a); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if r := recordFiles(t, u.stateDir); len(r) != 1 || r[0] != other {
		t.Errorf("record files after DEL = %v, want only %s", r, other)
	}
}
