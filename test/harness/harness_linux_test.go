package harness_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"testing"

	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

func TestNamespacesAreCreatedAndRemoved(t *testing.T) {
	harness.RequireRoot(t)
	n, err := harness.CreateNS("t")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Remove() })
	path := n.Path()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatalf("bind-mounted netns %s missing: %v", path, err)
	}
	want := fmt.Sprintf("net:[%d]", st.Ino)
	// /proc/self names the main thread, whose namespace the runtime may have
	// used for an unshare; only the calling thread's namespace is meaningful.
	runtime.LockOSThread()
	outside, _ := os.Readlink("/proc/thread-self/ns/net")
	runtime.UnlockOSThread()
	var inside string
	var loUp bool
	n.MustDo(t, func() error {
		var err error
		inside, err = os.Readlink("/proc/thread-self/ns/net")
		if err != nil {
			return err
		}
		lo, err := netlinksafe.LinkByName("lo")
		if err != nil {
			return err
		}
		loUp = lo.Attrs().Flags&1 != 0 // net.FlagUp
		return nil
	})
	if inside != want || outside == want {
		t.Fatalf("Do did not enter the namespace: inside=%q want=%q outside=%q", inside, want, outside)
	}
	if !loUp {
		t.Fatal("loopback is not up in the new namespace")
	}
	if err := n.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("netns file %s still exists after Remove (err=%v)", path, err)
	}
	if err := n.Remove(); err == nil {
		// Second removal closes an already closed handle; it must not panic,
		// and reports the close error only.
		t.Log("second Remove returned nil")
	}
}

func TestFdNamespaceAndVeth(t *testing.T) {
	a := harness.NewNS(t, "a")
	b := harness.NewNS(t, "b")
	harness.Veth(t, a, "va", b, "vb")
	harness.AddAddr(t, a, "va", "10.250.0.1/30")
	harness.AddAddr(t, b, "vb", "10.250.0.2/30")
	if !harness.LinkExists(t, a, "va") || !harness.LinkExists(t, b, "vb") {
		t.Fatal("veth ends missing")
	}
	if harness.LinkExists(t, a, "vb") {
		t.Fatal("peer end landed in the wrong namespace")
	}
	fd := harness.NewFdNS(t)
	var links []netlink.Link
	if err := fd.Do(func() error {
		var err error
		links, err = netlinksafe.LinkList()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(links) != 1 || links[0].Attrs().Name != "lo" {
		t.Fatalf("fd-held namespace should hold only lo, got %d links", len(links))
	}
	harness.Bridge(t, a, "aetbr")
	harness.Macvlan(t, b, "vb", "mv0")
	if !harness.LinkExists(t, b, "mv0") {
		t.Fatal("macvlan missing")
	}
}

// TestLibcniDrivesBridgeHostLocal runs the reference bridge + host-local chain
// through ADD, CHECK, DEL and DEL again at every CNI version, plus STATUS and
// GC where the version has them.
func TestLibcniDrivesBridgeHostLocal(t *testing.T) {
	harness.RequireRoot(t)
	bin := harness.ReferencePlugins(t)
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			ctx := context.Background()
			node := harness.NewNS(t, "node")
			pod := harness.NewNS(t, "pod")
			ipam, dataDir := harness.HostLocalIPAM(t, "10.251.0.0/24")
			conf := harness.ConfList(t, "harnessnet", ver, map[string]any{
				"type": "bridge", "bridge": "aetbr0", "isGateway": true, "ipam": ipam,
			})
			rt := harness.NewRuntime(t, node, []string{bin}, conf)
			p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: pod.Path(), Name: "p", Namespace: "ns", UID: "uid-1"}

			if ver == "1.1.0" {
				if err := rt.Status(ctx); err != nil {
					t.Fatalf("STATUS: %v", err)
				}
			}
			res, err := rt.Add(ctx, p)
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			r, err := current.NewResultFromResult(res)
			if err != nil {
				t.Fatal(err)
			}
			if len(r.IPs) != 1 || r.IPs[0].Address.IP.String() != "10.251.0.2" {
				t.Fatalf("unexpected IPs %v", r.IPs)
			}
			if !harness.LinkExists(t, pod, "eth0") {
				t.Fatal("eth0 missing in pod netns")
			}
			if !harness.LinkExists(t, node, "aetbr0") {
				t.Fatal("bridge missing in node netns")
			}
			if got := harness.Allocations(t, dataDir, "harnessnet"); !slices.Equal(got, []string{"10.251.0.2"}) {
				t.Fatalf("host-local allocations = %v", got)
			}
			if err := rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK: %v", err)
			}
			if ver == "1.1.0" {
				if err := rt.GC(ctx, p); err != nil {
					t.Fatalf("GC: %v", err)
				}
				if got := harness.Allocations(t, dataDir, "harnessnet"); len(got) != 1 {
					t.Fatalf("GC released a valid attachment: %v", got)
				}
			}
			if err := rt.Del(ctx, p); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if harness.LinkExists(t, pod, "eth0") {
				t.Fatal("eth0 still present after DEL")
			}
			if got := harness.Allocations(t, dataDir, "harnessnet"); len(got) != 0 {
				t.Fatalf("allocations left after DEL: %v", got)
			}
			if err := rt.Del(ctx, p); err != nil {
				t.Fatalf("second DEL: %v", err)
			}
			p.NetNS = ""
			if err := rt.Del(ctx, p); err != nil {
				t.Fatalf("DEL with empty netns: %v", err)
			}
		})
	}
}
