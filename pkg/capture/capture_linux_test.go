package capture_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/test/harness"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func TestMain(m *testing.M) { harness.Main(m) }

// TestInstallReplacesInPlace: a retried ADD whose configuration changed
// (every ordered pair of golden configurations) leaves exactly the new
// ruleset in the kernel, as a fresh install would, whether the retry only
// inserts rules and chains or rewrites the table, also when someone added
// a chain to our table meanwhile.
func TestInstallReplacesInPlace(t *testing.T) {
	if _, err := exec.LookPath("nft"); err != nil {
		t.Fatalf("nft binary needed to read the kernel's ruleset back: %v", err)
	}
	for from, fromCfg := range goldenConfigs {
		for to, toCfg := range goldenConfigs {
			if from == to {
				continue
			}
			for _, stray := range []bool{false, true} {
				name := from + "->" + to
				if stray {
					name += "+stray"
				}
				t.Run(name, func(t *testing.T) {
					pod := harness.NewNS(t, "repl")
					inst := capture.Installer{}
					if err := inst.Install(pod.Path(), capture.Build(fromCfg)); err != nil {
						t.Fatal(err)
					}
					pod.MustDo(t, func() error {
						if !stray {
							return nil
						}
						out, err := exec.Command("nft", "add", "chain", "inet", capture.TableName, "stray").CombinedOutput()
						if err != nil {
							return fmt.Errorf("nft add chain: %w: %s", err, out)
						}
						return nil
					})
					rs := capture.Build(toCfg)
					if err := inst.Install(pod.Path(), rs); err != nil {
						t.Fatal(err)
					}
					if err := inst.Verify(pod.Path(), rs); err != nil {
						t.Fatalf("Verify after the replacement: %v", err)
					}
					var out []byte
					pod.MustDo(t, func() error {
						var err error
						out, err = exec.Command("nft", "list", "table", "inet", capture.TableName).CombinedOutput()
						return err
					})
					if want := goldenTable(t, to); string(out) != want {
						t.Fatalf("kernel ruleset after %s differs from golden %s:\n--- nft list\n%s--- golden\n%s", name, to, out, want)
					}
				})
			}
		}
	}
}

// goldenTable is testdata/<name>.nft without its comment lines.
func goldenTable(t *testing.T, name string) string {
	t.Helper()
	want, err := os.ReadFile(filepath.Join("testdata", name+".nft"))
	if err != nil {
		t.Fatal(err)
	}
	var table []string
	for _, l := range strings.SplitAfter(string(want), "\n") {
		if !strings.HasPrefix(l, "#") {
			table = append(table, l)
		}
	}
	return strings.Join(table, "")
}

// goldenConfigs are the configurations whose exact ruleset is kept in testdata/.
var goldenConfigs = map[string]capture.Config{
	"scoped-default": {Ports: []uint16{capture.DefaultOutboundPort}},
	"redirect-all":   {RedirectAll: true},
	"redirect-all-excluded": {
		RedirectAll:  true,
		ExcludePorts: []uint16{3306, 22, 22},
		ExcludeCIDRs: []netip.Prefix{
			netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("192.0.2.7/32"),
			netip.MustParsePrefix("fd00::/8"),
		},
	},
	"scoped-ports-custom-marks": {
		CapturePort: 19001, Ports: []uint16{443, 80}, BypassMark: 0x10, DivertMark: 0x20,
		RouteTable: 200, RulePriority: 1000,
	},
	"inbound-default": {Ports: []uint16{capture.DefaultOutboundPort}, InboundCapture: true},
	// A divert put into a running pod (live enrolment).
	"live-redirect-all": {RedirectAll: true, SpareEstablished: true},
	"live-inbound":      {Ports: []uint16{80, 8080}, InboundCapture: true, SpareEstablished: true},
	"inbound-excluded": {
		RedirectAll: true, InboundCapture: true, InboundPort: 19008,
		ExcludeInboundPorts: []uint16{9090, 22, 22},
		InboundAllowCIDRs: []netip.Prefix{
			netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("10.77.0.1/32"),
			netip.MustParsePrefix("fd77::1/128"),
		},
	},
}

func TestGoldenRuleset(t *testing.T) {
	for name, cfg := range goldenConfigs {
		t.Run(name, func(t *testing.T) {
			got := capture.Build(cfg).Text()
			path := filepath.Join("testdata", name+".nft")
			if *update {
				if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("missing golden (run go test ./pkg/capture -update): %v", err)
			}
			if got != string(want) {
				t.Fatalf("ruleset for %s differs from %s:\n--- got\n%s--- want\n%s", name, path, got, want)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  capture.Config
		ok   bool
	}{
		{"scoped", capture.Config{Ports: []uint16{80}}, true},
		{"all", capture.Config{RedirectAll: true}, true},
		{"nothing captured", capture.Config{}, false},
		{"same marks", capture.Config{RedirectAll: true, BypassMark: 5, DivertMark: 5}, false},
		{"live", capture.Config{RedirectAll: true, SpareEstablished: true}, true},
		{"live, captured mark = divert mark", capture.Config{RedirectAll: true, SpareEstablished: true, CapturedMark: capture.DefaultDivertMark}, false},
		{"captured mark unused without SpareEstablished", capture.Config{RedirectAll: true, CapturedMark: capture.DefaultDivertMark}, true},
	} {
		err := tc.cfg.Normalize().Validate()
		if (err == nil) != tc.ok {
			t.Errorf("%s: Validate() = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

// topology: pod (10.77.0.2, fd77::2) -- veth -- remote (10.77.0.1, fd77::1,
// plus 10.78.0.1 and fd78::1), the pod's default routes via remote.
func topology(t *testing.T) (pod, remote *harness.NS) {
	pod = harness.NewNS(t, "pod")
	remote = harness.NewNS(t, "rem")
	for _, n := range []*harness.NS{pod, remote} {
		// No DAD on link-local addresses either, so the first IPv6 packet
		// on the wire is not held up by a tentative address.
		n.MustDo(t, func() error {
			return os.WriteFile("/proc/sys/net/ipv6/conf/default/accept_dad", []byte("0"), 0o644)
		})
	}
	harness.Veth(t, pod, "eth0", remote, "vr")
	harness.AddAddr(t, pod, "eth0", "10.77.0.2/24")
	harness.AddAddr(t, pod, "eth0", "fd77::2/64")
	harness.AddAddr(t, remote, "vr", "10.77.0.1/24")
	harness.AddAddr(t, remote, "vr", "fd77::1/64")
	harness.AddAddr(t, remote, "vr", "10.78.0.1/24")
	harness.AddAddr(t, remote, "vr", "fd78::1/64")
	pod.MustDo(t, func() error {
		l, err := netlinksafe.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, gw := range []string{"10.77.0.1", "fd77::1"} {
			if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: netip.MustParseAddr(gw).AsSlice()}); err != nil {
				return fmt.Errorf("failed to add default route via %s: %w", gw, err)
			}
		}
		return nil
	})
	capturetest.WaitAddrsSettled(t, pod)
	capturetest.WaitAddrsSettled(t, remote)
	return pod, remote
}

func TestInstallVerifyIdempotent(t *testing.T) {
	pod, _ := topology(t)
	inst := capture.Installer{}
	rs := capture.Build(goldenConfigs["redirect-all-excluded"])
	if ok, err := inst.Present(pod.Path()); err != nil || ok {
		t.Fatalf("Present before install = %v, %v", ok, err)
	}
	if err := inst.Verify(pod.Path(), rs); !errors.Is(err, capture.ErrNotInstalled) {
		t.Fatalf("Verify before install = %v, want ErrNotInstalled", err)
	}
	for i := range 2 { // a retried ADD installs again
		if err := inst.Install(pod.Path(), rs); err != nil {
			t.Fatalf("install %d: %v", i, err)
		}
		if err := inst.Verify(pod.Path(), rs); err != nil {
			t.Fatalf("verify after install %d: %v", i, err)
		}
	}
	// A different configuration is detected as a change.
	if err := inst.Verify(pod.Path(), capture.Build(capture.Config{RedirectAll: true})); err == nil {
		t.Fatal("Verify accepted a ruleset of another configuration")
	}
	// Deleting one rule by hand is detected.
	pod.MustDo(t, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		tbl := &nftables.Table{Name: capture.TableName, Family: nftables.TableFamilyINet}
		rules, err := c.GetRules(tbl, &nftables.Chain{Name: "divert", Table: tbl})
		if err != nil {
			return err
		}
		if err := c.DelRule(rules[len(rules)-1]); err != nil {
			return err
		}
		return c.Flush()
	})
	if err := inst.Verify(pod.Path(), rs); err == nil {
		t.Fatal("Verify passed after a rule was deleted")
	}
	if err := inst.Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	// Deleting the ip rule by hand is detected too.
	pod.MustDo(t, func() error {
		r := netlink.NewRule()
		r.Table, r.Priority, r.Mark = capture.DefaultRouteTable, capture.DefaultRulePriority, capture.DefaultDivertMark
		return netlink.RuleDel(r)
	})
	if err := inst.Verify(pod.Path(), rs); err == nil {
		t.Fatal("Verify passed after the ip rule was deleted")
	}
	if err := inst.Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	if err := inst.Verify(pod.Path(), rs); err != nil {
		t.Fatalf("verify after reinstall: %v", err)
	}
	// And the deliver mark's rule (IPv6 here).
	pod.MustDo(t, func() error {
		r := netlink.NewRule()
		r.Family = unix.AF_INET6
		r.Table, r.Priority, r.Mark = capture.DefaultRouteTable, capture.DefaultRulePriority, capture.DefaultDeliverMark
		return netlink.RuleDel(r)
	})
	if err := inst.Verify(pod.Path(), rs); err == nil || !strings.Contains(err.Error(), "0xae7d") {
		t.Fatalf("Verify after the deliver rule was deleted = %v, want it named", err)
	}
	if err := inst.Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	if err := inst.Verify(pod.Path(), rs); err != nil {
		t.Fatalf("verify after reinstall: %v", err)
	}
}

// TestPacketBehaviour checks where TCP and UDP, IPv4 and IPv6, land from the
// pod: captured destinations on the transparent capture listener with their
// original destination, exclusions and the proxy's bypass mark at the real
// destination.
func TestPacketBehaviour(t *testing.T) {
	for _, mode := range []string{"redirect-all", "scoped"} {
		t.Run(mode, func(t *testing.T) {
			pod, remote := topology(t)
			cfg := capture.Config{
				RedirectAll:  mode == "redirect-all",
				Ports:        []uint16{8080},
				ExcludePorts: []uint16{9999},
				ExcludeCIDRs: []netip.Prefix{netip.MustParsePrefix("10.78.0.0/24"), netip.MustParsePrefix("fd78::/64")},
			}
			if err := (capture.Installer{}).Install(pod.Path(), capture.Build(cfg)); err != nil {
				t.Fatal(err)
			}
			sink := capturetest.NewSink()
			all := []string{"tcp4", "tcp6", "udp4", "udp6"}
			capturetest.Listen(t, pod, sink, "capture", capture.DefaultCapturePort, true, all...)
			for _, port := range []uint16{80, 8080, 9999} {
				capturetest.Listen(t, remote, sink, "remote", port, false, all...)
			}
			capturetest.Listen(t, pod, sink, "pod-local", 7000, false, "tcp4", "tcp6")
			type tc struct {
				network string
				dst     string
				mark    uint32
				want    string
			}
			captured := func(dst string) string {
				if cfg.RedirectAll || netip.MustParseAddrPort(dst).Port() == 8080 {
					return "capture"
				}
				return "remote"
			}
			var cases []tc
			for _, n := range []string{"tcp", "udp"} {
				cases = append(cases,
					tc{n, "10.77.0.1:80", 0, captured("10.77.0.1:80")},
					tc{n, "[fd77::1]:80", 0, captured("[fd77::1]:80")},
					tc{n, "10.77.0.1:8080", 0, "capture"},
					tc{n, "[fd77::1]:8080", 0, "capture"},
					tc{n, "10.77.0.1:9999", 0, "remote"},      // excluded port
					tc{n, "[fd77::1]:9999", 0, "remote"},      // excluded port
					tc{n, "10.78.0.1:8080", 0, "remote"},      // excluded CIDR
					tc{n, "[fd78::1]:8080", 0, "remote"},      // excluded CIDR
					tc{n, "10.77.0.1:8080", 0xae7e, "remote"}, // the proxy's bypass mark
					tc{n, "[fd77::1]:8080", 0xae7e, "remote"},
				)
			}
			cases = append(cases, tc{"tcp", "127.0.0.1:7000", 0, "pod-local"}, tc{"tcp", "[::1]:7000", 0, "pod-local"},
				tc{"tcp", "10.77.0.2:7000", 0, "pod-local"})
			for i, c := range cases {
				payload := fmt.Sprintf("%s-%d-%s", mode, i, c.dst)
				dst := netip.MustParseAddrPort(c.dst)
				if err := capturetest.Send(pod, c.network, dst, payload, c.mark); err != nil {
					t.Errorf("%s %s mark %#x: %v", c.network, c.dst, c.mark, err)
					continue
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				got, err := sink.Wait(ctx, payload)
				cancel()
				if err != nil {
					t.Errorf("%s %s mark %#x: %v", c.network, c.dst, c.mark, err)
					continue
				}
				if got.Listener != c.want {
					t.Errorf("%s %s mark %#x landed on %s, want %s", c.network, c.dst, c.mark, got.Listener, c.want)
				}
				if got.Listener == "capture" && got.Dst != dst {
					t.Errorf("%s %s: capture listener saw original destination %s", c.network, c.dst, got.Dst)
				}
			}
		})
	}
}

// TestGoldenMatchesKernel installs each golden configuration and compares the
// golden text with what `nft list` reads back from the kernel (the nft binary
// is used by this test only, never by the plugin).
func TestGoldenMatchesKernel(t *testing.T) {
	if _, err := exec.LookPath("nft"); err != nil {
		t.Fatalf("nft binary needed to read the kernel's ruleset back: %v", err)
	}
	for name, cfg := range goldenConfigs {
		t.Run(name, func(t *testing.T) {
			pod := harness.NewNS(t, "gold")
			if err := (capture.Installer{}).Install(pod.Path(), capture.Build(cfg)); err != nil {
				t.Fatal(err)
			}
			var out []byte
			pod.MustDo(t, func() error {
				var err error
				out, err = exec.Command("nft", "list", "table", "inet", capture.TableName).CombinedOutput()
				return err
			})
			if got, want := string(out), goldenTable(t, name); got != want {
				t.Fatalf("kernel ruleset differs from golden %s:\n--- nft list\n%s--- golden\n%s", name, got, want)
			}
		})
	}
}

// nsSnapshot is the namespace's ip rules, routes of every table and
// nftables ruleset.
func nsSnapshot(t *testing.T, pod *harness.NS) string {
	t.Helper()
	var b strings.Builder
	cmds := [][]string{
		{"ip", "-4", "rule"},
		{"ip", "-6", "rule"},
		{"ip", "-4", "route", "show", "table", "all"},
		{"ip", "-6", "route", "show", "table", "all"},
		{"nft", "list", "ruleset"},
	}
	for _, args := range cmds {
		var out []byte
		pod.MustDo(t, func() error {
			var err error
			out, err = exec.Command(args[0], args[1:]...).CombinedOutput()
			if err != nil {
				return fmt.Errorf("%v: %w: %s", args, err, out)
			}
			return nil
		})
		fmt.Fprintf(&b, "## %s\n%s", strings.Join(args, " "), out)
	}
	return b.String()
}

// TestRemoveLeavesNothing: Remove takes out the table, the fwmark rules
// and the local routes of both families (the namespace is as before the
// install), also after an install that left only the routing behind, and
// a second Remove is no error.
func TestRemoveLeavesNothing(t *testing.T) {
	pod, _ := topology(t)
	inst := capture.Installer{}
	rs := capture.Build(goldenConfigs["redirect-all-excluded"])
	snapshot := func() string { return nsSnapshot(t, pod) }
	before := snapshot()
	if err := inst.Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	if snapshot() == before {
		t.Fatal("install changed nothing visible: the snapshot cannot tell")
	}
	for i := range 2 {
		if err := inst.Remove(pod.Path(), rs.Config); err != nil {
			t.Fatalf("remove %d: %v", i, err)
		}
		if after := snapshot(); after != before {
			t.Fatalf("remove %d left state behind:\n--- before\n%s\n--- after\n%s", i, before, after)
		}
	}
	// Routing without the table (an Install that failed half-way).
	if err := inst.Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	pod.MustDo(t, func() error {
		out, err := exec.Command("nft", "delete", "table", "inet", capture.TableName).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	})
	if err := inst.Remove(pod.Path(), rs.Config); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(); after != before {
		t.Fatalf("remove after a half install left state behind:\n--- before\n%s\n--- after\n%s", before, after)
	}
}

// TestInboundRedirect checks where TCP arriving at a pod with the inbound
// redirect lands: plaintext from outside on the transparent inbound listener
// with the original destination as its local address; HBONE (15008), an
// excluded port and an allowed source (the kubelet's) at the app directly;
// the pod's own traffic on lo and the replies of its outbound connections
// untouched. Without an inbound listener the connection is dropped, never
// delivered to the app; Remove restores direct delivery.
func TestInboundRedirect(t *testing.T) {
	pod, remote := topology(t)
	cfg := capture.Config{
		Ports: []uint16{capture.DefaultOutboundPort}, InboundCapture: true,
		ExcludeInboundPorts: []uint16{9999},
		InboundAllowCIDRs:   []netip.Prefix{netip.MustParsePrefix("10.78.0.1/32"), netip.MustParsePrefix("fd78::1/128")},
	}
	rs := capture.Build(cfg)
	if err := (capture.Installer{}).Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	sink := capturetest.NewSink()
	both := []string{"tcp4", "tcp6"}
	for _, port := range []uint16{8080, 9999} {
		capturetest.Listen(t, pod, sink, "app", port, false, both...)
	}
	capturetest.Listen(t, pod, sink, "hbone", capture.DefaultHBONEPort, false, both...)
	capturetest.Listen(t, remote, sink, "remote", 80, false, both...)

	// The inbound listener is bound (and closed) by the subtest that
	// needs it, so the drop without a listener is tested first.
	send := func(t *testing.T, from *harness.NS, src netip.Addr, dst, want string) {
		t.Helper()
		payload := fmt.Sprintf("%s-%s-%s", t.Name(), src, dst)
		d := netip.MustParseAddrPort(dst)
		if err := capturetest.SendFrom(from, "tcp", src, d, payload, 0); err != nil {
			t.Errorf("from %s to %s: %v", src, dst, err)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		got, err := sink.Wait(ctx, payload)
		if err != nil {
			t.Errorf("from %s to %s: %v", src, dst, err)
			return
		}
		if got.Listener != want {
			t.Errorf("from %s to %s landed on %s, want %s", src, dst, got.Listener, want)
		}
		if got.Dst != d {
			t.Errorf("from %s to %s: %s saw local address %s, want the original destination", src, dst, got.Listener, got.Dst)
		}
	}
	t.Run("no-listener-drops", func(t *testing.T) {
		for _, dst := range []string{"10.77.0.2:8080", "[fd77::2]:8080"} {
			payload := "dropped-" + dst
			var err error
			remote.MustDo(t, func() error {
				d := net.Dialer{Timeout: 300 * time.Millisecond}
				var c net.Conn
				if c, err = d.Dial("tcp", dst); err == nil {
					_, _ = c.Write([]byte(payload))
					c.Close()
				}
				return nil
			})
			if err == nil {
				t.Errorf("connection to %s without an inbound listener succeeded; want it dropped", dst)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			if got, err := sink.Wait(ctx, payload); err == nil {
				t.Errorf("%s reached %s past the inbound redirect", dst, got.Listener)
			}
			cancel()
		}
	})
	t.Run("redirected", func(t *testing.T) {
		capturetest.Listen(t, pod, sink, "inbound", capture.DefaultInboundPort, true, both...)
		none := netip.Addr{}
		send(t, remote, none, "10.77.0.2:8080", "inbound")
		send(t, remote, none, "[fd77::2]:8080", "inbound")
		send(t, remote, none, "10.77.0.2:9999", "app")    // excluded port
		send(t, remote, none, "[fd77::2]:9999", "app")    // excluded port
		send(t, remote, none, "10.77.0.2:15008", "hbone") // HBONE
		send(t, remote, none, "[fd77::2]:15008", "hbone")
		send(t, remote, netip.MustParseAddr("10.78.0.1"), "10.77.0.2:8080", "app") // allowed source
		send(t, remote, netip.MustParseAddr("fd78::1"), "[fd77::2]:8080", "app")
		// The pod's own traffic: on lo, and the replies of its outbound
		// connections (Send waits for the remote's answer).
		send(t, pod, none, "10.77.0.2:8080", "app")
		send(t, pod, none, "[fd77::2]:8080", "app")
		send(t, pod, none, "10.77.0.1:80", "remote")
		send(t, pod, none, "[fd77::1]:80", "remote")
	})
	if t.Failed() {
		return
	}
	if err := (capture.Installer{}).Remove(pod.Path(), rs.Config); err != nil {
		t.Fatal(err)
	}
	t.Run("removed", func(t *testing.T) {
		send(t, remote, netip.Addr{}, "10.77.0.2:8080", "app")
		send(t, remote, netip.Addr{}, "[fd77::2]:8080", "app")
	})
}
