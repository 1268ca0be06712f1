package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
)

// CNIVersions are the CNI spec versions this project's plugins claim; tests
// run the whole verb matrix at each.
var CNIVersions = []string{"0.4.0", "1.0.0", "1.1.0"}

// Pod is one pod sandbox as the runtime describes it to CNI.
type Pod struct {
	// ContainerID is the sandbox ID (CNI_CONTAINERID).
	ContainerID string
	// NetNS is the netns path (CNI_NETNS); empty models containerd's second DEL.
	NetNS string
	// IfName is CNI_IFNAME; "eth0" when empty.
	IfName string
	// Name, Namespace and UID become K8S_POD_NAME, K8S_POD_NAMESPACE and
	// K8S_POD_UID.
	Name, Namespace, UID string
	// OmitInfraID leaves K8S_POD_INFRA_CONTAINER_ID out, as some runtimes do.
	OmitInfraID bool
	// CapabilityArgs are runtimeConfig values (for example
	// "io.kubernetes.cri.pod-annotations").
	CapabilityArgs map[string]any
}

// RuntimeConf renders the pod the way containerd does: IgnoreUnknown=1 and
// the K8S_POD_* keys, in a random order (containerd builds them from a map).
func (p Pod) RuntimeConf() *libcni.RuntimeConf {
	args := [][2]string{
		{"IgnoreUnknown", "1"},
		{"K8S_POD_NAMESPACE", p.Namespace},
		{"K8S_POD_NAME", p.Name},
	}
	if !p.OmitInfraID {
		args = append(args, [2]string{"K8S_POD_INFRA_CONTAINER_ID", p.ContainerID})
	}
	if p.UID != "" {
		args = append(args, [2]string{"K8S_POD_UID", p.UID})
	}
	rand.Shuffle(len(args), func(i, j int) { args[i], args[j] = args[j], args[i] })
	ifName := p.IfName
	if ifName == "" {
		ifName = "eth0"
	}
	return &libcni.RuntimeConf{
		ContainerID:    p.ContainerID,
		NetNS:          p.NetNS,
		IfName:         ifName,
		Args:           args,
		CapabilityArgs: p.CapabilityArgs,
	}
}

// Runtime drives a conflist through libcni exactly as containerd does. The
// plugins run inside Node, a namespace that plays the host, so tests never
// touch the machine's own network.
type Runtime struct {
	// CNI is libcni's runtime with its own result cache directory.
	CNI *libcni.CNIConfig
	// List is the parsed conflist.
	List *libcni.NetworkConfigList
	// Node is the namespace the plugins execute in.
	Node *NS
}

// NewRuntime parses conflist and prepares a runtime whose plugins are looked
// up in binDirs and executed inside node.
func NewRuntime(tb testing.TB, node *NS, binDirs []string, conflist []byte) *Runtime {
	tb.Helper()
	return NewRuntimeExec(tb, node, binDirs, conflist, nil)
}

// NewRuntimeExec is NewRuntime with the plugin executor exec (libcni's own
// when nil), for example a RusageExec.
func NewRuntimeExec(tb testing.TB, node *NS, binDirs []string, conflist []byte, exec invoke.Exec) *Runtime {
	tb.Helper()
	list, err := libcni.NetworkConfFromBytes(conflist)
	if err != nil {
		tb.Fatalf("invalid conflist: %v\n%s", err, conflist)
	}
	return &Runtime{
		CNI:  libcni.NewCNIConfigWithCacheDir(binDirs, tb.TempDir(), exec),
		List: list,
		Node: node,
	}
}

func (r *Runtime) in(fn func() error) error {
	if r.Node == nil {
		return fn()
	}
	return r.Node.Do(fn)
}

// Add runs ADD over the whole chain and returns the final result.
func (r *Runtime) Add(ctx context.Context, p Pod) (types.Result, error) {
	var res types.Result
	err := r.in(func() error {
		var err error
		res, err = r.CNI.AddNetworkList(ctx, r.List, p.RuntimeConf())
		return err
	})
	return res, err
}

// Check runs CHECK over the chain with the cached prevResult.
func (r *Runtime) Check(ctx context.Context, p Pod) error {
	return r.in(func() error { return r.CNI.CheckNetworkList(ctx, r.List, p.RuntimeConf()) })
}

// Del runs DEL over the chain (reverse order) with the cached prevResult.
func (r *Runtime) Del(ctx context.Context, p Pod) error {
	return r.in(func() error { return r.CNI.DelNetworkList(ctx, r.List, p.RuntimeConf()) })
}

// GC runs GC with the given pods as the valid attachments.
func (r *Runtime) GC(ctx context.Context, valid ...Pod) error {
	args := &libcni.GCArgs{}
	for _, p := range valid {
		rc := p.RuntimeConf()
		args.ValidAttachments = append(args.ValidAttachments, types.GCAttachment{ContainerID: rc.ContainerID, IfName: rc.IfName})
	}
	return r.in(func() error { return r.CNI.GCNetworkList(ctx, r.List, args) })
}

// Status runs STATUS on every plugin of the chain.
func (r *Runtime) Status(ctx context.Context) error {
	return r.in(func() error { return r.CNI.GetStatusNetworkList(ctx, r.List) })
}

// ConfList renders a conflist with the given name, version and plugin objects.
func ConfList(tb testing.TB, name, cniVersion string, plugins ...map[string]any) []byte {
	tb.Helper()
	b, err := json.MarshalIndent(map[string]any{
		"cniVersion": cniVersion,
		"name":       name,
		"plugins":    plugins,
	}, "", "  ")
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// HostLocalIPAM returns a host-local IPAM section for the given ranges
// (each a subnet CIDR), storing its state under a test temp dir.
func HostLocalIPAM(tb testing.TB, subnets ...string) (ipam map[string]any, dataDir string) {
	tb.Helper()
	dataDir = filepath.Join(tb.TempDir(), "host-local")
	var ranges [][]map[string]any
	for _, s := range subnets {
		ranges = append(ranges, []map[string]any{{"subnet": s}})
	}
	return map[string]any{"type": "host-local", "dataDir": dataDir, "ranges": ranges}, dataDir
}

// Allocations lists the IPs host-local holds in dataDir for network name.
func Allocations(tb testing.TB, dataDir, network string) []string {
	tb.Helper()
	entries, err := os.ReadDir(filepath.Join(dataDir, network))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		tb.Fatalf("failed to read host-local store: %v", err)
	}
	var ips []string
	for _, e := range entries {
		n := e.Name()
		if n == "lock" || filepath.Ext(n) == ".0" || len(n) > 16 && n[:16] == "last_reserved_ip" {
			continue
		}
		ips = append(ips, n)
	}
	return ips
}

// ContainerID returns a fresh sandbox-style ID (64 hex characters).
func ContainerID() string {
	b := make([]byte, 32)
	for i := range b {
		b[i] = byte(rand.IntN(256))
	}
	return fmt.Sprintf("%x", b)
}
