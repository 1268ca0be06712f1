package listener_test

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/xds/listener"
)

func pod(ips ...string) listener.Pod {
	p := listener.Pod{ContainerID: "c0ffee", Namespace: "default", Name: "client", UID: "u-1", NetNSPath: "/var/run/netns/cni-1"}
	for _, ip := range ips {
		p.IPs = append(p.IPs, netip.MustParseAddr(ip))
	}
	return p
}

func TestDefaultsAgreeWithCapture(t *testing.T) {
	if listener.DefaultCapturePort != capture.DefaultCapturePort || listener.DefaultOutboundPort != capture.DefaultOutboundPort ||
		listener.DefaultInboundPort != capture.DefaultInboundPort {
		t.Fatalf("listener ports %d/%d/%d differ from the divert's %d/%d/%d",
			listener.DefaultCapturePort, listener.DefaultOutboundPort, listener.DefaultInboundPort,
			capture.DefaultCapturePort, capture.DefaultOutboundPort, capture.DefaultInboundPort)
	}
}

func TestBuildParse(t *testing.T) {
	tests := []struct {
		name  string
		pod   listener.Pod
		binds map[listener.Role][]listener.Bind
	}{
		{
			name: "ipv4",
			pod:  pod("10.0.0.2"),
			binds: map[listener.Role][]listener.Bind{
				listener.RoleOutbound:   {{Addr: netip.MustParseAddrPort("127.0.0.1:18081")}},
				listener.RoleCapture:    {{Addr: netip.MustParseAddrPort("0.0.0.0:18001")}},
				listener.RoleCaptureUDP: {{Addr: netip.MustParseAddrPort("0.0.0.0:18001"), UDP: true}},
				listener.RoleInbound:    {{Addr: netip.MustParseAddrPort("0.0.0.0:18008")}},
			},
		},
		{
			name: "dual-stack",
			pod:  pod("10.0.0.2", "fd00::2"),
			binds: map[listener.Role][]listener.Bind{
				listener.RoleOutbound: {{Addr: netip.MustParseAddrPort("127.0.0.1:18081")}, {Addr: netip.MustParseAddrPort("[::1]:18081")}},
				listener.RoleCapture:  {{Addr: netip.MustParseAddrPort("0.0.0.0:18001")}, {Addr: netip.MustParseAddrPort("[::]:18001")}},
				listener.RoleCaptureUDP: {
					{Addr: netip.MustParseAddrPort("0.0.0.0:18001"), UDP: true},
					{Addr: netip.MustParseAddrPort("[::]:18001"), UDP: true},
				},
				listener.RoleInbound: {{Addr: netip.MustParseAddrPort("0.0.0.0:18008")}, {Addr: netip.MustParseAddrPort("[::]:18008")}},
			},
		},
		{
			name: "ipv4-uds-strict",
			pod: func() listener.Pod {
				p := pod("10.0.0.2")
				p.UDSSocket = "/var/run/aether/uds/uid-1/app.sock"
				p.InboundPolicy = meshcontract.InboundPolicyStrict
				return p
			}(),
			binds: map[listener.Role][]listener.Bind{
				listener.RoleOutbound:   {{Addr: netip.MustParseAddrPort("127.0.0.1:18081")}},
				listener.RoleCapture:    {{Addr: netip.MustParseAddrPort("0.0.0.0:18001")}},
				listener.RoleCaptureUDP: {{Addr: netip.MustParseAddrPort("0.0.0.0:18001"), UDP: true}},
				listener.RoleInbound:    {{Addr: netip.MustParseAddrPort("0.0.0.0:18008")}},
			},
		},
		{
			name: "ipv6-only-custom-ports",
			pod: func() listener.Pod {
				p := pod("fd00::2")
				p.Ports = listener.Ports{Outbound: 19081, Capture: 19001, Inbound: 19008}
				return p
			}(),
			binds: map[listener.Role][]listener.Bind{
				listener.RoleOutbound:   {{Addr: netip.MustParseAddrPort("[::1]:19081")}},
				listener.RoleCapture:    {{Addr: netip.MustParseAddrPort("[::]:19001")}},
				listener.RoleCaptureUDP: {{Addr: netip.MustParseAddrPort("[::]:19001"), UDP: true}},
				listener.RoleInbound:    {{Addr: netip.MustParseAddrPort("[::]:19008")}},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ls, err := listener.Build(tc.pod)
			if err != nil {
				t.Fatal(err)
			}
			if len(ls) != len(listener.Roles) {
				t.Fatalf("built %d listeners, want %d", len(ls), len(listener.Roles))
			}
			for _, l := range ls {
				if err := l.ValidateAll(); err != nil {
					t.Errorf("listener %s: ValidateAll: %v", l.GetName(), err)
				}
				s, err := listener.Parse(l)
				if err != nil {
					t.Fatal(err)
				}
				if s.PodKey != tc.pod.ContainerID || s.Namespace != tc.pod.Namespace || s.PodName != tc.pod.Name || s.NetNSPath != tc.pod.NetNSPath {
					t.Errorf("listener %s parsed as pod %q %s/%s in %q", l.GetName(), s.PodKey, s.Namespace, s.PodName, s.NetNSPath)
				}
				if len(s.PodIPs) != len(tc.pod.IPs) || s.PodIPs[0] != tc.pod.IPs[0] {
					t.Errorf("listener %s parsed pod IPs %v, want %v", l.GetName(), s.PodIPs, tc.pod.IPs)
				}
				if s.UID != tc.pod.UID {
					t.Errorf("listener %s parsed pod uid %q, want %q", l.GetName(), s.UID, tc.pod.UID)
				}
				if s.UDSSocket != tc.pod.UDSSocket {
					t.Errorf("listener %s parsed UDS socket %q, want %q", l.GetName(), s.UDSSocket, tc.pod.UDSSocket)
				}
				if l.GetName() != listener.ListenerName(tc.pod.ContainerID, s.Role) {
					t.Errorf("listener name %q, role %q", l.GetName(), s.Role)
				}
				want := tc.binds[s.Role]
				if len(s.Binds) != len(want) {
					t.Fatalf("%s binds %v, want %v", s.Role, s.Binds, want)
				}
				for i := range want {
					if s.Binds[i] != want[i] {
						t.Errorf("%s bind %d = %v, want %v", s.Role, i, s.Binds[i], want[i])
					}
				}
				if want := tc.pod.InboundPolicy; s.InboundPolicy != want && (want != "" || s.InboundPolicy != meshcontract.InboundPolicyPermissive) {
					t.Errorf("listener %s parsed inbound policy %q, want %q", l.GetName(), s.InboundPolicy, want)
				}
				// The inbound listener is transparent: the inbound redirect
				// TPROXYs plaintext to it.
				wantTransparent := s.Role == listener.RoleCapture || s.Role == listener.RoleCaptureUDP || s.Role == listener.RoleInbound
				if s.Transparent != wantTransparent {
					t.Errorf("%s transparent = %v, want %v", s.Role, s.Transparent, wantTransparent)
				}
			}
		})
	}
}

func TestBuildRejects(t *testing.T) {
	tests := []struct {
		name string
		mut  func(*listener.Pod)
		want string
	}{
		{"no container id", func(p *listener.Pod) { p.ContainerID = "" }, "container id"},
		{"slash in container id", func(p *listener.Pod) { p.ContainerID = "a/b" }, "container id"},
		{"no name", func(p *listener.Pod) { p.Name = "" }, "name"},
		{"relative netns", func(p *listener.Pod) { p.NetNSPath = "netns/x" }, "must be absolute"},
		{"no ips", func(p *listener.Pod) { p.IPs = nil }, "no IPs"},
		{"relative uds socket", func(p *listener.Pod) { p.UDSSocket = "uid/app.sock" }, "must be an absolute path"},
		{"unknown inbound policy", func(p *listener.Pod) { p.InboundPolicy = "strcit" }, "inbound policy"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := pod("10.0.0.2")
			tc.mut(&p)
			_, err := listener.Build(p)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Build = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestParseRejects(t *testing.T) {
	good := func() *listenerv3.Listener {
		ls, err := listener.Build(pod("10.0.0.2", "fd00::2"))
		if err != nil {
			t.Fatal(err)
		}
		return ls[1]
	}
	if _, err := listener.Parse(&listenerv3.Listener{Name: "foreign"}); !errors.Is(err, listener.ErrNotOurs) {
		t.Errorf("Parse(foreign) = %v, want ErrNotOurs", err)
	}
	l := good()
	l.AdditionalAddresses[0].GetAddress().GetSocketAddress().NetworkNamespaceFilepath = "/other"
	if _, err := listener.Parse(l); err == nil || !strings.Contains(err.Error(), "network_namespace_filepath") {
		t.Errorf("Parse(mixed netns) = %v", err)
	}
	l = good()
	l.Name = "aether/c0ffee/bogus"
	if _, err := listener.Parse(l); err == nil || !strings.Contains(err.Error(), "role") {
		t.Errorf("Parse(bad role) = %v", err)
	}
	l = good()
	l.GetAddress().GetSocketAddress().Address = "not-an-ip"
	if _, err := listener.Parse(l); err == nil {
		t.Error("Parse accepted a non-IP address")
	}
}

// TestParseInboundPolicy: an absent policy (an agent that predates it) is
// permissive; a value the proxy does not know is strict (fail safe).
func TestParseInboundPolicy(t *testing.T) {
	tests := []struct{ meta, want string }{
		{"", meshcontract.InboundPolicyPermissive},
		{meshcontract.InboundPolicyPermissive, meshcontract.InboundPolicyPermissive},
		{meshcontract.InboundPolicyStrict, meshcontract.InboundPolicyStrict},
		{"STRICT-ish", meshcontract.InboundPolicyStrict},
	}
	for _, tc := range tests {
		t.Run(tc.meta, func(t *testing.T) {
			ls, err := listener.Build(pod("10.0.0.2"))
			if err != nil {
				t.Fatal(err)
			}
			l := ls[len(ls)-1]
			if tc.meta != "" {
				l.GetMetadata().GetFilterMetadata()[listener.MetadataKey].Fields["inbound_policy"] = structpb.NewStringValue(tc.meta)
			}
			s, err := listener.Parse(l)
			if err != nil {
				t.Fatal(err)
			}
			if s.InboundPolicy != tc.want {
				t.Errorf("inbound_policy %q parsed as %q, want %q", tc.meta, s.InboundPolicy, tc.want)
			}
		})
	}
}

// TestDeclaredPortsRoundTrip: Build then Parse keeps the declared ports on
// every listener of the pod, tells "declares none" (known, empty) from
// "unknown" (an agent that predates them sends neither key), and Parse
// rejects a malformed list rather than guessing.
func TestDeclaredPortsRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name  string
		known bool
		ports []uint16
	}{
		{name: "unknown"},
		{name: "declares none", known: true},
		{name: "declares some", known: true, ports: []uint16{80, 8080, 65535}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := pod("10.0.0.2")
			p.DeclaredPortsKnown, p.DeclaredTCPPorts = tc.known, tc.ports
			ls, err := listener.Build(p)
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range ls {
				s, err := listener.Parse(l)
				if err != nil {
					t.Fatal(err)
				}
				if s.DeclaredPortsKnown != tc.known || !slices.Equal(s.DeclaredTCPPorts, tc.ports) {
					t.Errorf("listener %s parsed declared ports known=%v %v, want known=%v %v", l.GetName(), s.DeclaredPortsKnown, s.DeclaredTCPPorts, tc.known, tc.ports)
				}
			}
			md := ls[0].GetMetadata().GetFilterMetadata()[listener.MetadataKey].GetFields()
			if _, ok := md["declared_ports_known"]; ok != tc.known {
				t.Errorf("declared_ports_known present = %v, want %v", ok, tc.known)
			}
		})
	}

	p := pod("10.0.0.2")
	p.DeclaredTCPPorts = []uint16{80}
	if _, err := listener.Build(p); err == nil || !strings.Contains(err.Error(), "DeclaredPortsKnown") {
		t.Errorf("Build with ports but not known = %v, want an error naming DeclaredPortsKnown", err)
	}
	p.DeclaredPortsKnown, p.DeclaredTCPPorts = true, []uint16{0}
	if _, err := listener.Build(p); err == nil || !strings.Contains(err.Error(), "1-65535") {
		t.Errorf("Build with port 0 = %v, want an error naming the range", err)
	}

	for name, mut := range map[string]func(map[string]*structpb.Value){
		"ports without known": func(f map[string]*structpb.Value) {
			delete(f, "declared_ports_known")
		},
		"known false":    func(f map[string]*structpb.Value) { f["declared_ports_known"] = structpb.NewBoolValue(false) },
		"known a string": func(f map[string]*structpb.Value) { f["declared_ports_known"] = structpb.NewStringValue("true") },
		"port 0": func(f map[string]*structpb.Value) {
			f["declared_tcp_ports"] = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(0)}})
		},
		"port 65536": func(f map[string]*structpb.Value) {
			f["declared_tcp_ports"] = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(65536)}})
		},
		"port 80.5": func(f map[string]*structpb.Value) {
			f["declared_tcp_ports"] = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(80.5)}})
		},
		"port a string": func(f map[string]*structpb.Value) {
			f["declared_tcp_ports"] = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewStringValue("80")}})
		},
	} {
		t.Run(name, func(t *testing.T) {
			p := pod("10.0.0.2")
			p.DeclaredPortsKnown, p.DeclaredTCPPorts = true, []uint16{80}
			ls, err := listener.Build(p)
			if err != nil {
				t.Fatal(err)
			}
			l := ls[len(ls)-1]
			mut(l.GetMetadata().GetFilterMetadata()[listener.MetadataKey].GetFields())
			if _, err := listener.Parse(l); err == nil || !strings.Contains(err.Error(), "declared_") {
				t.Errorf("Parse = %v, want an error naming the declared ports key", err)
			}
		})
	}
}
