// Package crinetns finds a running pod's network namespace through the
// container runtime's CRI (the socket kubelet uses): the pod's ready sandbox
// by its uid label, then the sandbox's verbose status, which carries the OCI
// runtime spec's network namespace path and the sandbox's PID. It needs no
// record kept at CNI ADD, so it finds pods the agent ignored at ADD, or that
// started before aether-node was installed and never went through
// aether-cni: what live enrolment needs to put the divert into them.
package crinetns

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// PodUIDLabel is the sandbox label kubelet sets to the pod's uid.
const PodUIDLabel = "io.kubernetes.pod.uid"

// ErrNoSandbox means the runtime has no ready sandbox of the pod (not
// started yet, stopped, or not on this node).
var ErrNoSandbox = errors.New("no ready pod sandbox")

// ErrHostNetwork means the pod's sandbox shares the node's network
// namespace: there is no pod netns to capture in.
var ErrHostNetwork = errors.New("pod sandbox runs in the node's network namespace")

// Sandbox is a pod's ready sandbox and where its network namespace is.
type Sandbox struct {
	// ID is the sandbox (pod) container ID, the CNI's CNI_CONTAINERID.
	ID string
	// NetnsPath is the network namespace's path: the runtime's bind mount
	// when its spec names one, else /proc/<PID>/ns/net.
	NetnsPath string
	// PID is the sandbox's process (0 when the runtime does not say).
	PID int
}

// Finder asks one runtime. Build it with New.
type Finder struct {
	rt runtimeapi.RuntimeServiceClient
}

// New returns a Finder over a CRI runtime client.
func New(rt runtimeapi.RuntimeServiceClient) *Finder { return &Finder{rt: rt} }

// Find returns the ready sandbox of the pod with uid (the newest, should
// the runtime hold more than one), or ErrNoSandbox, or ErrHostNetwork.
func (f *Finder) Find(ctx context.Context, uid string) (Sandbox, error) {
	list, err := f.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State:         &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{PodUIDLabel: uid},
	}})
	if err != nil {
		return Sandbox{}, fmt.Errorf("failed to list the sandboxes of pod uid %q: %w", uid, err)
	}
	var newest *runtimeapi.PodSandbox
	for _, s := range list.GetItems() {
		if newest == nil || s.GetCreatedAt() > newest.GetCreatedAt() {
			newest = s
		}
	}
	if newest == nil {
		return Sandbox{}, fmt.Errorf("pod uid %q: %w", uid, ErrNoSandbox)
	}
	return f.status(ctx, newest.GetId())
}

// sandboxInfo is what the verbose status's "info" JSON says of the
// network namespace (containerd's and CRI-O's shape).
type sandboxInfo struct {
	PID         int `json:"pid"`
	RuntimeSpec struct {
		Linux struct {
			Namespaces []struct {
				Type string `json:"type"`
				Path string `json:"path"`
			} `json:"namespaces"`
		} `json:"linux"`
	} `json:"runtimeSpec"`
}

// status reads sandbox id's network namespace from its verbose status.
func (f *Finder) status(ctx context.Context, id string) (Sandbox, error) {
	st, err := f.rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		return Sandbox{}, fmt.Errorf("failed to read the status of sandbox %s: %w", id, err)
	}
	if st.GetStatus().GetState() != runtimeapi.PodSandboxState_SANDBOX_READY {
		return Sandbox{}, fmt.Errorf("sandbox %s: %w", id, ErrNoSandbox)
	}
	if st.GetStatus().GetLinux().GetNamespaces().GetOptions().GetNetwork() == runtimeapi.NamespaceMode_NODE {
		return Sandbox{}, fmt.Errorf("sandbox %s: %w", id, ErrHostNetwork)
	}
	var info sandboxInfo
	if raw := st.GetInfo()["info"]; raw != "" {
		if err := json.Unmarshal([]byte(raw), &info); err != nil {
			return Sandbox{}, fmt.Errorf("failed to parse the verbose status of sandbox %s: %w", id, err)
		}
	}
	sb := Sandbox{ID: id, PID: info.PID}
	for _, n := range info.RuntimeSpec.Linux.Namespaces {
		if n.Type == "network" && n.Path != "" {
			sb.NetnsPath = n.Path
		}
	}
	if sb.NetnsPath == "" && sb.PID > 0 {
		sb.NetnsPath = "/proc/" + strconv.Itoa(sb.PID) + "/ns/net"
	}
	if sb.NetnsPath == "" {
		return Sandbox{}, fmt.Errorf("sandbox %s: the runtime names neither a network namespace path nor a pid (verbose status without info)", id)
	}
	if _, err := os.Stat(sb.NetnsPath); err != nil {
		return Sandbox{}, fmt.Errorf("sandbox %s: network namespace %w", id, err)
	}
	return sb, nil
}
