package csi

import (
	"context"
	"maps"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/uuid"
	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"aether.io/node/test/harness"
)

// inlineVolumes stands in for kubelet in the sanity suite. The suite gets
// its volumes from a Controller's CreateVolume; csi.aether.io has no
// Controller service because kubelet itself makes an inline volume's id and
// context. This fixture does what kubelet does: each CreateVolume returns a
// volume whose context carries csi.storage.k8s.io/ephemeral=true and a
// fresh pod uid (podInfoOnMount), so the Node specs publish and unpublish
// real inline volumes through the driver.
//
// The suite also asks the controller address for the Identity service; the
// fixture forwards those calls to the driver, so every Identity answer is
// the driver's.
type inlineVolumes struct {
	csipb.UnimplementedControllerServer
	csipb.UnimplementedIdentityServer
	driver csipb.IdentityClient
}

func (v inlineVolumes) GetPluginInfo(ctx context.Context, req *csipb.GetPluginInfoRequest) (*csipb.GetPluginInfoResponse, error) {
	return v.driver.GetPluginInfo(ctx, req)
}

func (v inlineVolumes) GetPluginCapabilities(ctx context.Context, req *csipb.GetPluginCapabilitiesRequest) (*csipb.GetPluginCapabilitiesResponse, error) {
	return v.driver.GetPluginCapabilities(ctx, req)
}

func (v inlineVolumes) Probe(ctx context.Context, req *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	return v.driver.Probe(ctx, req)
}

func (inlineVolumes) CreateVolume(_ context.Context, req *csipb.CreateVolumeRequest) (*csipb.CreateVolumeResponse, error) {
	vctx := maps.Clone(req.GetParameters())
	if vctx == nil {
		vctx = map[string]string{}
	}
	vctx[ContextPodUID] = uuid.NewString()
	return &csipb.CreateVolumeResponse{Volume: &csipb.Volume{VolumeId: "csi-" + req.GetName(), VolumeContext: vctx}}, nil
}

func (inlineVolumes) DeleteVolume(context.Context, *csipb.DeleteVolumeRequest) (*csipb.DeleteVolumeResponse, error) {
	return &csipb.DeleteVolumeResponse{}, nil
}

// serve serves srv on a unix socket at path until the test ends.
func serve(t *testing.T, srv *grpc.Server, path string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Stop(); <-done })
}

// TestSanity runs the upstream CSI sanity suite (csi-test pkg/sanity)
// against the driver's Identity and Node services over its unix socket,
// with real bind mounts in the test binary's private mount namespace. The
// Controller specs are skipped: the driver has no Controller service (the
// fixture above is kubelet's stand-in, not a driver under test).
func TestSanity(t *testing.T) {
	d, cfg := mountedDriver(t)
	harness.RequireRoot(t)
	ctx, cancel := context.WithCancel(context.Background())
	endpoint := filepath.Join(filepath.Dir(cfg.KubeletDir), "plugins", "csi.sock")
	l, err := Listen(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- d.Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	kubelet := filepath.Join(filepath.Dir(cfg.KubeletDir), "kubelet-standin.sock")
	conn, err := grpc.NewClient("unix://"+endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	standin := inlineVolumes{driver: csipb.NewIdentityClient(conn)}
	fixture := grpc.NewServer()
	csipb.RegisterControllerServer(fixture, standin)
	csipb.RegisterIdentityServer(fixture, standin)
	serve(t, fixture, kubelet)

	sc := sanity.NewTestConfig()
	sc.Address = "unix://" + endpoint
	sc.ControllerAddress = "unix://" + kubelet
	sc.TargetPath = filepath.Join(cfg.KubeletDir, "sanity-target")
	sc.StagingPath = filepath.Join(cfg.KubeletDir, "sanity-staging")
	sc.TestVolumeParameters = map[string]string{ContextEphemeral: "true"}
	tc := sanity.GinkgoTest(&sc)
	t.Cleanup(tc.Finalize)

	var report ginkgo.Report
	ginkgo.ReportAfterSuite("summary", func(r ginkgo.Report) { report = r })
	gomega.RegisterFailHandler(ginkgo.Fail)
	suite, reporter := ginkgo.GinkgoConfiguration()
	suite.SkipStrings = []string{`\[Controller Server\]`}
	reporter.Succinct = true
	reporter.NoColor = true
	ok := ginkgo.RunSpecs(t, "csi.aether.io sanity", suite, reporter)

	counts := map[string]int{}
	for _, s := range report.SpecReports {
		if s.LeafNodeType != types.NodeTypeIt {
			continue // suite-level nodes (the summary reporter)
		}
		state := s.State.String()
		counts[state]++
		line := strings.TrimSpace(strings.Join(append(s.ContainerHierarchyTexts, s.LeafNodeText), " / "))
		if s.State.Is(types.SpecStateSkipped) && s.Failure.Message != "" {
			line += " (" + s.Failure.Message + ")"
		}
		t.Logf("%-7s %s", state, line)
	}
	t.Logf("sanity: %v", counts)
	if !ok {
		t.Fatal("csi sanity failed")
	}
	if counts["passed"] == 0 {
		t.Fatal("csi sanity ran no spec")
	}
	if _, err := os.Stat(sc.TargetPath); !os.IsNotExist(err) {
		t.Errorf("sanity left %s: %v", sc.TargetPath, err)
	}
	// Every pod dir a spec's publish made went with its unpublish.
	if left, err := os.ReadDir(cfg.Root); err != nil || len(left) != 0 {
		t.Errorf("pod dirs left under %s: %v, %v", cfg.Root, left, err)
	}
}
