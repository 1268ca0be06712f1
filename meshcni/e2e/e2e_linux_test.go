package e2e_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	mdnetlink "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/test/harness"
)

// readyz stands in for the proxy's outbound listener: GET /aether/readyz
// answers 200 on 127.0.0.1:18081 inside the pod netns.
func readyz(t *testing.T, pod *harness.NS) {
	t.Helper()
	var l net.Listener
	pod.MustDo(t, func() error {
		var err error
		l, err = net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", capture.DefaultOutboundPort))
		return err
	})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/aether/readyz" {
			w.WriteHeader(http.StatusNotFound)
		}
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
}

// TestManagedPod runs a mesh-managed pod through ADD, CHECK, a hand-made
// change, CHECK, ADD again, CHECK, DEL at every CNI version, and checks
// where its TCP and UDP traffic (IPv4 and IPv6) lands.
func TestManagedPod(t *testing.T) {
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, ver, map[string]any{
				"readiness_probe_budget_ms": 5000,
				"capture": map[string]any{
					"redirect_all": true, "exclude_ports": []int{9999},
					"exclude_cidrs": []string{exclSubnet4, exclSubnet6},
				},
			})
			p, podNS := newPod(t, "web")
			p.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": map[string]string{
				"capture.aether.io/exclude-outbound-ports": "7777",
			}}
			e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
			readyz(t, podNS)
			res, err := e.rt.Add(ctx, p)
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if !tablePresent(t, podNS) {
				t.Fatal("no capture table after ADD of a managed pod")
			}
			agent := e.agent.Client(t)
			rec, err := agent.GetPod(ctx, p.ContainerID)
			if err != nil {
				t.Fatalf("GetPod: %v", err)
			}
			if !rec.Managed || rec.Uncaptured || rec.Pod == nil || rec.Pod.NetworkNamespace != e.pinDir+"/"+p.ContainerID {
				t.Fatalf("agent record: %+v", rec)
			}
			tm := rec.LastTimings
			if tm == nil || tm.Started == nil || tm.PreCall == nil || tm.ReadinessProbe == nil || tm.CaptureDivert == nil || tm.Total == nil {
				t.Fatalf("timings not reported to the agent: %+v", tm)
			}
			if tm.ReadinessProbeError != "" || tm.CaptureDivertError != "" {
				t.Fatalf("probe/divert errors reported: %+v", tm)
			}
			if _, err := os.Stat(e.pinDir + "/" + p.ContainerID); err != nil {
				t.Fatalf("netns not pinned: %v", err)
			}

			// Packet behaviour.
			harness.AddAddr(t, e.node, "aetbr0", "10.250.9.1/24")
			harness.AddAddr(t, e.node, "aetbr0", "fd10:99::1/64")
			settle(t, podNS, e.node)
			sink := capturetest.NewSink()
			all := []string{"tcp4", "tcp6", "udp4", "udp6"}
			capturetest.Listen(t, podNS, sink, "capture", capture.DefaultCapturePort, true, all...)
			for _, port := range []uint16{8080, 9999, 7777} {
				capturetest.Listen(t, e.node, sink, "node", port, false, all...)
			}
			for i, c := range []struct{ network, dst, want string }{
				{"tcp", "198.51.100.7:8080", "capture"},
				{"tcp", "[2001:db8::7]:8080", "capture"},
				{"udp", "198.51.100.7:8080", "capture"},
				{"udp", "[2001:db8::7]:8080", "capture"},
				{"tcp", gw4 + ":8080", "capture"},
				{"tcp", "[" + gw6 + "]:8080", "capture"},
				{"tcp", gw4 + ":9999", "node"},        // netconf exclude_ports
				{"udp", "[" + gw6 + "]:9999", "node"}, // netconf exclude_ports
				{"tcp", "10.250.9.1:8080", "node"},    // netconf exclude_cidrs
				{"tcp", "[fd10:99::1]:8080", "node"},  // netconf exclude_cidrs
				{"udp", "10.250.9.1:8080", "node"},    // netconf exclude_cidrs
				{"tcp", gw4 + ":7777", "node"},        // pod annotation
				{"tcp", "[" + gw6 + "]:7777", "node"}, // pod annotation
			} {
				payload := fmt.Sprintf("%s-%d", ver, i)
				dst := netip.MustParseAddrPort(c.dst)
				if err := capturetest.Send(podNS, c.network, dst, payload, 0); err != nil {
					t.Errorf("%s %s: %v", c.network, c.dst, err)
					continue
				}
				wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				got, err := sink.Wait(wctx, payload)
				cancel()
				if err != nil {
					t.Errorf("%s %s: %v", c.network, c.dst, err)
					continue
				}
				if got.Listener != c.want || got.Listener == "capture" && got.Dst != dst {
					t.Errorf("%s %s landed on %s (dst %s), want %s", c.network, c.dst, got.Listener, got.Dst, c.want)
				}
			}

			// CHECK: passes, fails after a hand-made change, passes after ADD.
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK after ADD: %v", err)
			}
			deleteLastDivertRule(t, podNS)
			if err := e.rt.Check(ctx, p); err == nil {
				t.Fatal("CHECK passed after a capture rule was deleted by hand")
			}
			if err := e.addMeshOnly(ctx, p, res); err != nil {
				t.Fatalf("ADD again: %v", err)
			}
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK after ADD again: %v", err)
			}

			// A retry whose divert lost exclusions rewrites the table (a
			// commit that removes rules): the plugin hands the netfilter
			// socket to its socket closer, which exits after the plugin and
			// leaves nothing. The next retry (exclusions back) inserts.
			full := e.mesh["capture"]
			e.mesh["capture"] = map[string]any{"redirect_all": true, "exclude_ports": []int{9999}}
			if err := e.addMeshOnly(ctx, p, res); err != nil {
				t.Fatalf("ADD with fewer exclusions: %v", err)
			}
			e.mesh["capture"] = full
			checkCloserTook(t, filepath.Join(e.agent.Dir, "cni.log"), 1)
			waitNoCloser(t, e.node)
			if err := e.addMeshOnly(ctx, p, res); err != nil {
				t.Fatalf("ADD with the exclusions back: %v", err)
			}
			checkCloserTook(t, filepath.Join(e.agent.Dir, "cni.log"), 1)
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK after the retries: %v", err)
			}

			if err := e.rt.Del(ctx, p); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if _, err := agent.GetPod(ctx, p.ContainerID); !errors.Is(err, agentclient.ErrNotFound) {
				t.Fatalf("agent still holds the pod after DEL: %v", err)
			}
			if _, err := os.Stat(e.pinDir + "/" + p.ContainerID); !os.IsNotExist(err) {
				t.Fatalf("pin left after DEL: %v", err)
			}
		})
	}
}

// TestUnmanagedPodGetsNothing: a pod without aether.io/managed=true is
// IGNORED by the agent; the plugin installs no table, no ip rule, no pin.
func TestUnmanagedPodGetsNothing(t *testing.T) {
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, ver, nil)
			p, podNS := newPod(t, "plain")
			e.agent.WritePod(t, p.Namespace, p.Name, p.UID, false, nil)
			res, err := e.rt.Add(ctx, p)
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if res == nil {
				t.Fatal("no result passed through")
			}
			if tablePresent(t, podNS) {
				t.Fatal("capture table installed for an unmanaged pod")
			}
			if err := (capture.Installer{}).Verify(podNS.Path(), capture.Build(capture.Config{Ports: []uint16{18081}})); !errors.Is(err, capture.ErrNotInstalled) {
				t.Fatalf("Verify on an unmanaged pod = %v", err)
			}
			if _, err := os.Stat(e.pinDir + "/" + p.ContainerID); !os.IsNotExist(err) {
				t.Fatalf("unmanaged pod pinned: %v", err)
			}
			if _, err := e.agent.Client(t).GetPod(ctx, p.ContainerID); !errors.Is(err, agentclient.ErrNotFound) {
				t.Fatalf("GetPod of an ignored pod = %v, want NOT_FOUND", err)
			}
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK: %v", err)
			}
			if err := e.rt.Del(ctx, p); err != nil {
				t.Fatalf("DEL: %v", err)
			}
		})
	}
}

// TestDelMatrix: DEL twice, without ADD, with an empty netns, with a deleted
// netns, with the agent down (code 11, then success once it is back) and
// after an agent restart, at every CNI version.
func TestDelMatrix(t *testing.T) {
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, ver, map[string]any{"readiness_probe_disabled": true})
			add := func(name string) (harness.Pod, *harness.NS) {
				p, ns := newPod(t, name)
				e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
				if _, err := e.rt.Add(ctx, p); err != nil {
					t.Fatalf("ADD %s: %v", name, err)
				}
				return p, ns
			}
			gone := func(p harness.Pod) {
				t.Helper()
				if _, err := e.agent.Client(t).GetPod(ctx, p.ContainerID); !errors.Is(err, agentclient.ErrNotFound) {
					t.Errorf("%s: agent record left after DEL: %v", p.Name, err)
				}
				if _, err := os.Stat(e.pinDir + "/" + p.ContainerID); !os.IsNotExist(err) {
					t.Errorf("%s: pin left after DEL", p.Name)
				}
			}

			t.Run("twice", func(t *testing.T) {
				p, _ := add("twice")
				for i := range 2 {
					if err := e.rt.Del(ctx, p); err != nil {
						t.Fatalf("DEL %d: %v", i, err)
					}
				}
				gone(p)
			})
			t.Run("without ADD", func(t *testing.T) {
				p, _ := newPod(t, "never")
				if err := e.rt.Del(ctx, p); err != nil {
					t.Fatalf("DEL: %v", err)
				}
			})
			t.Run("empty netns", func(t *testing.T) {
				p, _ := add("emptyns")
				q := p
				q.NetNS = ""
				if err := e.rt.Del(ctx, q); err != nil {
					t.Fatalf("DEL with empty CNI_NETNS: %v", err)
				}
				gone(p)
				if err := e.rt.Del(ctx, p); err != nil {
					t.Fatalf("DEL again with the path: %v", err)
				}
			})
			t.Run("deleted netns", func(t *testing.T) {
				p, ns := add("delns")
				// The runtime removes its netns file (the pin keeps the
				// namespace itself alive).
				if err := syscall.Unmount(ns.Path(), syscall.MNT_DETACH); err != nil {
					t.Fatal(err)
				}
				if err := os.Remove(ns.Path()); err != nil {
					t.Fatal(err)
				}
				if err := e.rt.Del(ctx, p); err != nil {
					t.Fatalf("DEL with the netns gone: %v", err)
				}
				gone(p)
			})
			t.Run("agent restarted", func(t *testing.T) {
				p, _ := add("restart")
				e.agent.Stop()
				e.agent.Restart()
				if err := e.rt.Del(ctx, p); err != nil {
					t.Fatalf("DEL after agent restart: %v", err)
				}
				gone(p)
			})
			t.Run("agent down", func(t *testing.T) {
				p, _ := add("down")
				e.agent.Stop()
				err := e.rt.Del(ctx, p)
				if cniCode(err) != 11 || !strings.Contains(err.Error(), "aether-agent") {
					t.Fatalf("DEL with the agent down = %v, want code 11 naming aether-agent", err)
				}
				e.agent.Restart()
				if err := e.rt.Del(ctx, p); err != nil {
					t.Fatalf("DEL once the agent is back: %v", err)
				}
				gone(p)
			})
		})
	}
}

// TestAddAgentDown: ADD fails with code 11 and leaves no pin.
func TestAddAgentDown(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "1.0.0", map[string]any{"readiness_probe_disabled": true})
	p, _ := newPod(t, "nodown")
	e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
	e.agent.Stop()
	_, err := e.rt.Add(ctx, p)
	if cniCode(err) != 11 || !strings.Contains(err.Error(), "aether-agent") {
		t.Fatalf("ADD with the agent down = %v, want code 11", err)
	}
	if names, _ := os.ReadDir(e.pinDir); len(names) != 0 {
		t.Fatalf("pins left after a failed ADD: %v", names)
	}
}

// TestStatusAndGC: STATUS follows the agent; GC unpins every pin whose
// attachment is not valid and keeps the valid ones.
func TestStatusAndGC(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "1.1.0", map[string]any{"readiness_probe_disabled": true})
	if err := e.rt.Status(ctx); err != nil {
		t.Fatalf("STATUS with the agent up: %v", err)
	}
	keep, _ := newPod(t, "keep")
	drop, _ := newPod(t, "drop")
	for _, p := range []harness.Pod{keep, drop} {
		e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
		if _, err := e.rt.Add(ctx, p); err != nil {
			t.Fatalf("ADD %s: %v", p.Name, err)
		}
	}
	if err := e.rt.GC(ctx, keep); err != nil {
		t.Fatalf("GC: %v", err)
	}
	if _, err := os.Stat(e.pinDir + "/" + keep.ContainerID); err != nil {
		t.Fatalf("GC removed a valid pin: %v", err)
	}
	if _, err := os.Stat(e.pinDir + "/" + drop.ContainerID); !os.IsNotExist(err) {
		t.Fatalf("GC kept a stale pin: %v", err)
	}
	e.agent.Stop()
	if err := e.rt.Status(ctx); cniCode(err) != 50 {
		t.Fatalf("STATUS with the agent down = %v, want code 50", err)
	}
	e.agent.Restart()
	for _, p := range []harness.Pod{keep, drop} {
		if err := e.rt.Del(ctx, p); err != nil {
			t.Fatalf("DEL %s: %v", p.Name, err)
		}
	}
}

// ownTable creates, in ns, table inet name with NFT_TABLE_F_OWNER through
// its own netlink socket: while that socket is open nobody else may change
// or delete the table. google/nftables does not send table flags, so the
// batch is written here.
func ownTable(t *testing.T, ns *harness.NS, name string) {
	t.Helper()
	conn, err := mdnetlink.Dial(unix.NETLINK_NETFILTER, &mdnetlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	nfgen := func(family byte, resID uint16) []byte {
		return []byte{family, 0 /* NFNETLINK_V0 */, byte(resID >> 8), byte(resID)}
	}
	ae := mdnetlink.NewAttributeEncoder()
	ae.ByteOrder = binary.BigEndian
	ae.String(unix.NFTA_TABLE_NAME, name)
	ae.Uint32(unix.NFTA_TABLE_FLAGS, 0x2) // NFT_TABLE_F_OWNER
	attrs, err := ae.Encode()
	if err != nil {
		t.Fatal(err)
	}
	msgs := []mdnetlink.Message{
		{Header: mdnetlink.Header{Type: mdnetlink.HeaderType(unix.NFNL_MSG_BATCH_BEGIN), Flags: mdnetlink.Request}, Data: nfgen(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES)},
		{Header: mdnetlink.Header{Type: mdnetlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWTABLE), Flags: mdnetlink.Request | mdnetlink.Acknowledge | mdnetlink.Create}, Data: append(nfgen(unix.NFPROTO_INET, 0), attrs...)},
		{Header: mdnetlink.Header{Type: mdnetlink.HeaderType(unix.NFNL_MSG_BATCH_END), Flags: mdnetlink.Request}, Data: nfgen(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES)},
	}
	if _, err := conn.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Receive(); err != nil {
		t.Fatalf("failed to create owned table: %v", err)
	}
}

// TestDivertFailureFailOpen: under capture_failure "open", when the
// divert cannot be installed (here the pod netns holds a table of that name
// owned by another netlink socket), ADD still succeeds, the failure reaches
// the agent (uncaptured, capture_divert_error) and CHECK fails.
func TestDivertFailureFailOpen(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "1.0.0", map[string]any{"readiness_probe_disabled": true, "capture_failure": "open"})
	p, podNS := newPod(t, "owned")
	e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
	ownTable(t, podNS, capture.TableName)
	if _, err := e.rt.Add(ctx, p); err != nil {
		t.Fatalf("ADD failed on a divert failure: %v", err)
	}
	rec, err := e.agent.Client(t).GetPod(ctx, p.ContainerID)
	if err != nil {
		t.Fatal(err)
	}
	if !rec.Uncaptured || rec.LastTimings == nil || rec.LastTimings.CaptureDivertError == "" {
		t.Fatalf("divert failure not reported: uncaptured=%v timings=%+v", rec.Uncaptured, rec.LastTimings)
	}
	t.Logf("reported: %s", rec.LastTimings.CaptureDivertError)
	if err := e.rt.Check(ctx, p); err == nil {
		t.Fatal("CHECK passed for a pod whose divert failed")
	}
	if err := e.rt.Del(ctx, p); err != nil {
		t.Fatalf("DEL: %v", err)
	}
}

// divertRouting is what of the divert's policy routing the pod netns
// holds: fwmark rules, and routes in the divert's table ("" = none).
func divertRouting(t *testing.T, ns *harness.NS) string {
	t.Helper()
	table := fmt.Sprint(capture.DefaultRouteTable)
	var b strings.Builder
	for _, args := range [][]string{{"-4", "rule"}, {"-6", "rule"}, {"-4", "route", "show", "table", table}, {"-6", "route", "show", "table", table}} {
		ns.MustDo(t, func() error {
			out, err := exec.Command("ip", args...).CombinedOutput()
			if err != nil && bytes.Contains(out, []byte("table does not exist")) {
				return nil // the kernel never had a route in it
			}
			if err != nil {
				return fmt.Errorf("ip %v: %w: %s", args, err, out)
			}
			for _, l := range strings.Split(string(out), "\n") {
				if args[1] == "route" && strings.TrimSpace(l) != "" || strings.Contains(l, "fwmark") {
					fmt.Fprintf(&b, "%v: %s\n", args, l)
				}
			}
			return nil
		})
	}
	return b.String()
}

// TestCaptureFailureFailLeavesNothing: under capture_failure "fail" (the
// default) an ADD whose readiness probe never answers (code 11) or whose
// divert cannot be installed (code 999) fails, and leaves nothing: no
// divert table, fwmark rule or route, no agent record, no netns pin; the
// runtime's DEL afterwards succeeds.
func TestCaptureFailureFailLeavesNothing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		conf     map[string]any
		owned    bool // another socket owns the capture table: Install fails
		wantCode uint
	}{
		{"probe never answers", map[string]any{"readiness_probe_budget_ms": 300}, false, types.ErrTryAgainLater},
		{"divert cannot be installed", map[string]any{"readiness_probe_disabled": true, "capture_failure": "fail"}, true, types.ErrInternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t, "1.0.0", tc.conf)
			p, podNS := newPod(t, "strict")
			e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
			if tc.owned {
				ownTable(t, podNS, capture.TableName)
			}
			_, err := e.rt.Add(ctx, p)
			if code := cniCode(err); code != tc.wantCode || !strings.Contains(err.Error(), "capture_failure") {
				t.Fatalf("ADD = %v (code %d), want code %d naming capture_failure", err, code, tc.wantCode)
			}
			t.Logf("ADD failed as it should: %v", err)
			if left := divertRouting(t, podNS); left != "" {
				t.Errorf("failed ADD left divert routing behind:\n%s", left)
			}
			if !tc.owned && tablePresent(t, podNS) {
				t.Error("failed ADD left the capture table")
			}
			if _, err := e.agent.Client(t).GetPod(ctx, p.ContainerID); !errors.Is(err, agentclient.ErrNotFound) {
				t.Errorf("agent still has a record of the failed pod: GetPod = %v", err)
			}
			if _, err := os.Lstat(filepath.Join(e.pinDir, p.ContainerID)); !os.IsNotExist(err) {
				t.Errorf("failed ADD left its netns pin: %v", err)
			}
			if err := e.rt.Del(ctx, p); err != nil {
				t.Fatalf("DEL after the failed ADD: %v", err)
			}
		})
	}
}

// TestDelayedUnpin: with netns_unpin_delay_seconds the pin outlives DEL and
// a detached helper (the plugin binary re-executed) removes it later.
func TestDelayedUnpin(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, "1.0.0", map[string]any{"readiness_probe_disabled": true, "netns_unpin_delay_seconds": 1})
	p, _ := newPod(t, "late")
	e.agent.WritePod(t, p.Namespace, p.Name, p.UID, true, nil)
	if _, err := e.rt.Add(ctx, p); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	pinPath := e.pinDir + "/" + p.ContainerID
	if err := e.rt.Del(ctx, p); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if _, err := os.Stat(pinPath); err != nil {
		t.Fatalf("pin gone at DEL despite the delay: %v", err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := os.Stat(pinPath); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("pin never removed by the delayed unpin")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
