package csi

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"aether.io/node/pkg/meshcontract"
)

// testUID is a pod uid of the shape Kubernetes gives.
const testUID = "6f1c2b3a-9d4e-4f5a-8b7c-1d2e3f4a5b6c"

// refusingMounter fails the test if a request that must be refused reaches
// the mount table.
type refusingMounter struct{ t *testing.T }

func (m refusingMounter) Bind(dir, target string) error {
	m.t.Errorf("Bind(%q, %q) called for a refused request", dir, target)
	return nil
}

func (m refusingMounter) Unmount(target string) error {
	m.t.Errorf("Unmount(%q) called for a refused request", target)
	return nil
}

func (m refusingMounter) MountPoints() ([]string, error) {
	m.t.Error("MountPoints called for a refused request")
	return nil, nil
}

// testDriver returns a driver whose root and kubelet dir are fresh temp dirs.
func testDriver(t *testing.T, m Mounter) (*Driver, Config) {
	t.Helper()
	// A short temp dir: socket paths under it must fit sun_path (107 bytes).
	dir, err := os.MkdirTemp("", "csi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	cfg := Config{
		NodeName:   "node-a",
		Root:       filepath.Join(dir, "uds"),
		KubeletDir: filepath.Join(dir, "kubelet"),
		Version:    "v-test",
	}
	if err := os.MkdirAll(cfg.KubeletDir, 0o750); err != nil {
		t.Fatal(err)
	}
	d, err := New(cfg, m, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	return d, cfg
}

// publishReq is a valid inline-volume publish request for uid at target.
func publishReq(target, uid string) *csipb.NodePublishVolumeRequest {
	return &csipb.NodePublishVolumeRequest{
		VolumeId:   "csi-" + uid,
		TargetPath: target,
		VolumeCapability: &csipb.VolumeCapability{
			AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}},
			AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		},
		VolumeContext: map[string]string{ContextEphemeral: "true", ContextPodUID: uid},
	}
}

func TestPublishRefusesBadRequests(t *testing.T) {
	for _, tc := range []struct {
		name string
		// edit turns a valid request into the bad one; kubelet is the
		// kubelet dir, outside a dir outside it.
		edit func(r *csipb.NodePublishVolumeRequest, kubelet, outside string)
		// want are substrings of the message: what was wrong, what is allowed.
		want []string
	}{
		{"missing volume id", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.VolumeId = "" }, []string{"volume_id is missing"}},
		{"missing target", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.TargetPath = "" }, []string{"target_path is missing", "must be a path under"}},
		{"relative target", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.TargetPath = "pods/x/mount" }, []string{"not a clean absolute path under the kubelet directory"}},
		{"target outside the kubelet dir", func(r *csipb.NodePublishVolumeRequest, _, outside string) {
			r.TargetPath = filepath.Join(outside, "mount")
		}, []string{"not a clean absolute path under the kubelet directory"}},
		{"target escaping with ..", func(r *csipb.NodePublishVolumeRequest, kubelet, _ string) {
			r.TargetPath = kubelet + "/pods/../../etc/mount"
		}, []string{"not a clean absolute path"}},
		{"target is the kubelet dir", func(r *csipb.NodePublishVolumeRequest, kubelet, _ string) { r.TargetPath = kubelet }, []string{"under the kubelet directory"}},
		{"target through a symlink out of the kubelet dir", func(r *csipb.NodePublishVolumeRequest, kubelet, outside string) {
			link := filepath.Join(kubelet, "escape")
			if err := os.Symlink(outside, link); err != nil {
				panic(err)
			}
			r.TargetPath = filepath.Join(link, "mount")
		}, []string{"resolves to", "outside the kubelet directory"}},
		{"target below a symlink out of the kubelet dir, parent missing", func(r *csipb.NodePublishVolumeRequest, kubelet, outside string) {
			link := filepath.Join(kubelet, "escape")
			if err := os.Symlink(outside, link); err != nil {
				panic(err)
			}
			r.TargetPath = filepath.Join(link, "new", "dirs", "mount")
		}, []string{"resolves to", "outside the kubelet directory"}},
		{"missing capability", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.VolumeCapability = nil }, []string{"volume_capability is missing", "mount capability is required"}},
		{"block capability", func(r *csipb.NodePublishVolumeRequest, _, _ string) {
			r.VolumeCapability.AccessType = &csipb.VolumeCapability_Block{Block: &csipb.VolumeCapability_BlockVolume{}}
		}, []string{"must be a mount", "not a block device"}},
		{"mount flags", func(r *csipb.NodePublishVolumeRequest, _, _ string) {
			r.VolumeCapability.GetMount().MountFlags = []string{"ro"}
		}, []string{"mount flags", "nosuid,nodev,noexec"}},
		{"reader-only access mode", func(r *csipb.NodePublishVolumeRequest, _, _ string) {
			r.VolumeCapability.AccessMode.Mode = csipb.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
		}, []string{"MULTI_NODE_READER_ONLY is not supported", "SINGLE_NODE_WRITER"}},
		{"non-numeric mount group", func(r *csipb.NodePublishVolumeRequest, _, _ string) {
			r.VolumeCapability.GetMount().VolumeMountGroup = "wheel"
		}, []string{`"wheel" is not a numeric gid`}},
		{"read-only", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.Readonly = true }, []string{"readonly is not supported", "remove readOnly"}},
		{"not ephemeral", func(r *csipb.NodePublishVolumeRequest, _, _ string) { delete(r.VolumeContext, ContextEphemeral) }, []string{"only inline ephemeral volumes", "volumeLifecycleModes: [Ephemeral]"}},
		{"ephemeral false", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.VolumeContext[ContextEphemeral] = "false" }, []string{`ephemeral="false"`}},
		{"missing pod uid", func(r *csipb.NodePublishVolumeRequest, _, _ string) { delete(r.VolumeContext, ContextPodUID) }, []string{ContextPodUID + " is missing", "podInfoOnMount: true"}},
		{"pod uid with a slash", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.VolumeContext[ContextPodUID] = "a/b" }, []string{`"a/b" is not a pod uid`}},
		{"pod uid ..", func(r *csipb.NodePublishVolumeRequest, _, _ string) { r.VolumeContext[ContextPodUID] = ".." }, []string{`".." is not a pod uid`}},
		{"pod uid too long", func(r *csipb.NodePublishVolumeRequest, _, _ string) {
			r.VolumeContext[ContextPodUID] = strings.Repeat("a", 65)
		}, []string{"is not a pod uid", "1 to 64"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, cfg := testDriver(t, refusingMounter{t})
			req := publishReq(filepath.Join(cfg.KubeletDir, "pods", testUID, "volumes", "kubernetes.io~csi", "sock", "mount"), testUID)
			tc.edit(req, cfg.KubeletDir, t.TempDir())
			_, err := d.NodePublishVolume(context.Background(), req)
			if got := status.Code(err); got != codes.InvalidArgument {
				t.Fatalf("code %s (%v), want InvalidArgument", got, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if _, err := os.Stat(cfg.Root); !os.IsNotExist(err) {
				t.Errorf("a refused request created the root %s: %v", cfg.Root, err)
			}
		})
	}
}

func TestUnpublishRefusesBadRequests(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  func(kubelet string) *csipb.NodeUnpublishVolumeRequest
		want string
	}{
		{"missing volume id", func(k string) *csipb.NodeUnpublishVolumeRequest {
			return &csipb.NodeUnpublishVolumeRequest{TargetPath: k + "/pods/x/mount"}
		}, "volume_id is missing"},
		{"missing target", func(string) *csipb.NodeUnpublishVolumeRequest {
			return &csipb.NodeUnpublishVolumeRequest{VolumeId: "v"}
		}, "target_path is missing"},
		{"target outside the kubelet dir", func(string) *csipb.NodeUnpublishVolumeRequest {
			return &csipb.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: "/etc"}
		}, "not a clean absolute path under the kubelet directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, cfg := testDriver(t, refusingMounter{t})
			_, err := d.NodeUnpublishVolume(context.Background(), tc.req(cfg.KubeletDir))
			if got := status.Code(err); got != codes.InvalidArgument {
				t.Fatalf("code %s (%v), want InvalidArgument", got, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not contain %q", err, tc.want)
			}
		})
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	ok := Config{NodeName: "n", Root: "/run/aether/uds", KubeletDir: "/var/lib/kubelet"}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"relative root", func(c *Config) { c.Root = "run/uds" }, "--uds-csi-root"},
		{"root /", func(c *Config) { c.Root = "/" }, "--uds-csi-root"},
		{"unclean kubelet dir", func(c *Config) { c.KubeletDir = "/var/lib/kubelet/" }, "--kubelet-dir"},
		{"no node name", func(c *Config) { c.NodeName = "" }, "--node-name"},
		{"relative registration dir", func(c *Config) { c.RegistrationDir = "plugins_registry" }, "--registration-dir"},
		{"unclean kubelet endpoint", func(c *Config) { c.KubeletEndpoint = "/k//csi.sock" }, "--kubelet-registration-path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.edit(&c)
			if _, err := New(c, refusingMounter{t}, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

func TestIdentityAndNodeInfo(t *testing.T) {
	d, _ := testDriver(t, refusingMounter{t})
	ctx := context.Background()
	info, err := d.GetPluginInfo(ctx, &csipb.GetPluginInfoRequest{})
	if err != nil || info.GetName() != "csi.aether.io" || info.GetVendorVersion() != "v-test" {
		t.Errorf("GetPluginInfo = %v, %v; want csi.aether.io v-test", info, err)
	}
	caps, err := d.GetPluginCapabilities(ctx, &csipb.GetPluginCapabilitiesRequest{})
	if err != nil || len(caps.GetCapabilities()) != 0 {
		t.Errorf("GetPluginCapabilities = %v, %v; want none (no controller service)", caps, err)
	}
	ni, err := d.NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
	if err != nil || ni.GetNodeId() != "node-a" {
		t.Errorf("NodeGetInfo = %v, %v; want node id node-a", ni, err)
	}
	nc, err := d.NodeGetCapabilities(ctx, &csipb.NodeGetCapabilitiesRequest{})
	if err != nil || len(nc.GetCapabilities()) != 1 || nc.GetCapabilities()[0].GetRpc().GetType() != csipb.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP {
		t.Errorf("NodeGetCapabilities = %v, %v; want VOLUME_MOUNT_GROUP only", nc, err)
	}
	if p, err := d.Probe(ctx, &csipb.ProbeRequest{}); err != nil || p.GetReady().GetValue() {
		t.Errorf("Probe before the root exists = %v, %v; want not ready", p, err)
	}
}

// TestFlagsShareTheAgentsRoot checks the driver reads <uds-csi-root> from
// the flag name and default the agent uses (meshcontract; the agent's side
// is checked in agent/app).
func TestFlagsShareTheAgentsRoot(t *testing.T) {
	c, err := ParseFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Root != meshcontract.DefaultUDSCSIRoot || c.KubeletDir != DefaultKubeletDir || c.Endpoint != DefaultEndpoint {
		t.Errorf("defaults %+v", c)
	}
	c, err = ParseFlags([]string{"--" + meshcontract.UDSCSIRootFlag, "/x/uds", "--log-level", "debug"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Root != "/x/uds" || c.LogLevel != slog.LevelDebug {
		t.Errorf("--uds-csi-root /x/uds --log-level debug gave %+v", c)
	}
	if _, err := ParseFlags([]string{"extra"}, io.Discard); err == nil {
		t.Error("a positional argument was accepted")
	}
}

// TestRegistrationFlags checks where the built-in registration goes:
// <kubelet-dir>/plugins_registry unless --registration-dir says otherwise,
// off when it is empty, announcing --endpoint unless
// --kubelet-registration-path names kubelet's view of it.
func TestRegistrationFlags(t *testing.T) {
	for _, tt := range []struct {
		args         []string
		wantDir      string
		wantEndpoint string
	}{
		{nil, "/var/lib/kubelet/plugins_registry", DefaultEndpoint},
		{[]string{"--kubelet-dir", "/k"}, "/k/plugins_registry", DefaultEndpoint},
		{[]string{"--kubelet-dir", "/k", "--registration-dir", "/reg"}, "/reg", DefaultEndpoint},
		{[]string{"--registration-dir="}, "", DefaultEndpoint},
		{[]string{"--endpoint", "/k/plugins/csi.aether.io/csi.sock"}, "/var/lib/kubelet/plugins_registry", "/k/plugins/csi.aether.io/csi.sock"},
		{[]string{"--endpoint", "/csi/csi.sock", "--kubelet-registration-path", "/k/p/csi.sock"}, "/var/lib/kubelet/plugins_registry", "/k/p/csi.sock"},
	} {
		c, err := ParseFlags(tt.args, io.Discard)
		if err != nil {
			t.Fatalf("ParseFlags(%q): %v", tt.args, err)
		}
		if c.RegistrationDir != tt.wantDir || c.KubeletEndpoint != tt.wantEndpoint {
			t.Errorf("ParseFlags(%q): registration dir %q, kubelet endpoint %q; want %q, %q", tt.args, c.RegistrationDir, c.KubeletEndpoint, tt.wantDir, tt.wantEndpoint)
		}
	}
}
