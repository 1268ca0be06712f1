package e2e

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/ctl"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) {
	if os.Getenv(clientModeEnv) != "" {
		os.Exit(runClientMode())
	}
	if os.Getenv(peerModeEnv) != "" {
		os.Exit(runPeerMode())
	}
	harness.Main(m)
}

func cniPod(ns, name, cid string, ips ...string) *cniv1.CNIPod {
	return &cniv1.CNIPod{Name: name, Namespace: ns, ContainerId: cid, NetworkNamespace: "/var/run/netns/" + cid, Ips: ips}
}

func TestManifestSourceAddGetReportRemove(t *testing.T) {
	harness.RequireRoot(t)
	dir := newAgentDirs(t)
	mdir := filepath.Join(dir, "manifests")
	if err := os.Mkdir(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeManifest(t, mdir, "web.yaml", podYAML("shop", "web-1", "uid-web-1", true, "    endpoint.aether.io/uds-socket: scratch/app.sock", `  volumes:
  - name: mesh
    csi:
      driver: csi.aether.io
  - name: scratch
    emptyDir: {}`))
	writeManifest(t, mdir, "plain.yaml", podYAML("shop", "plain", "uid-plain", false, "", ""))
	a := startAgent(t, dir, "--pod-manifests", mdir, "--pod-manifests-interval", "50ms")
	a.waitReady(t)
	c := a.client(t)

	// Managed pod: SUCCESS, fields filled from the manifest.
	resp, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "web-1", "cid-web-1", "10.1.0.5", "fd00::5")})
	if err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod managed = %v, %v; want SUCCESS", resp, err)
	}
	got, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-web-1"})
	if err != nil {
		t.Fatalf("GetPod: %v", err)
	}
	p := got.GetPod()
	if p.GetUid() != "uid-web-1" || p.GetServiceAccount() != "sa-web-1" || p.GetLabels()["app"] != "web-1" ||
		p.GetAnnotations()["team"] != "mesh" || p.GetUdsCsiVolume() != "mesh" || p.GetUdsCsiVolumes() != 1 ||
		strings.Join(p.GetVolumes(), ",") != "mesh,scratch" || p.GetTerminating() || !got.GetManaged() || !got.GetRegistered() {
		t.Fatalf("GetPod = %v", got)
	}

	// Unmanaged pod: IGNORED and nothing stored.
	resp, err = c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "plain", "cid-plain", "10.1.0.6")})
	if err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_IGNORED {
		t.Fatalf("AddPod unmanaged = %v, %v; want IGNORED", resp, err)
	}
	if _, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-plain"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetPod of ignored pod: %v, want NotFound", err)
	}
	// System namespace and no IPs: IGNORED without a lookup.
	for _, pod := range []*cniv1.CNIPod{cniPod("kube-system", "dns", "cid-dns", "10.1.0.7"), cniPod("shop", "web-1", "cid-noip")} {
		resp, err = c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: pod})
		if err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_IGNORED {
			t.Fatalf("AddPod %s = %v, %v; want IGNORED", pod.GetContainerId(), resp, err)
		}
	}

	// Unknown pod: retried within the deadline, then Unavailable (the agent answers
	// up to 250 ms before the caller's deadline; 3 s leaves room for a slow rescan under load).
	_, err = c.AddPod(ctxT(t, 3*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "ghost", "cid-ghost", "10.1.0.8")})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("AddPod of unknown pod: %v, want Unavailable", err)
	}
	// A manifest that appears while AddPod waits is found.
	done := make(chan error, 1)
	go func() {
		r, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "late", "cid-late", "10.1.0.9")})
		if err == nil && r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
			err = status.Errorf(codes.Unknown, "result %v", r.GetResult())
		}
		done <- err
	}()
	time.Sleep(200 * time.Millisecond)
	writeManifest(t, mdir, "late.yaml", podYAML("shop", "late", "uid-late", true, "", ""))
	if err := <-done; err != nil {
		t.Fatalf("AddPod of a pod whose manifest appeared late: %v", err)
	}

	// Invalid request: InvalidArgument naming the violated rule.
	bad := cniPod("shop", "web-1", "cid-bad", "not-an-ip")
	bad.NetworkNamespace = "relative"
	_, err = c.AddPod(ctxT(t, 5*time.Second), &cniv1.AddPodRequest{Pod: bad})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "string.prefix") || !strings.Contains(err.Error(), "pod.network_namespace") {
		t.Fatalf("AddPod invalid = %v; want InvalidArgument naming pod.network_namespace and string.prefix", err)
	}

	// ReportAddResult with a divert error: uncaptured, persisted, WARN.
	_, err = c.ReportAddResult(ctxT(t, 5*time.Second), &cniv1.ReportAddResultRequest{
		ContainerId: "cid-web-1", Name: "web-1", Namespace: "shop",
		Timings: &cniv1.PluginTimings{
			PreCall: durationpb.New(time.Millisecond), CaptureDivert: durationpb.New(2 * time.Millisecond),
			CaptureDivertError: "nft: no such table", Total: durationpb.New(9 * time.Millisecond),
		},
	})
	if err != nil {
		t.Fatalf("ReportAddResult: %v", err)
	}
	got, _ = c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-web-1"})
	if !got.GetUncaptured() || got.GetLastTimings().GetTotal().AsDuration() != 9*time.Millisecond {
		t.Fatalf("after report: %v", got)
	}
	if l := a.logs.find("pod running UNCAPTURED"); l == nil || l["level"] != "WARN" || l["name"] != "web-1" || l["namespace"] != "shop" {
		t.Fatalf("no WARN pod running UNCAPTURED with pod identity: %v", l)
	}
	if v := a.metric(t, `aether_cni_operations_total{operation="capture_divert",result="error"}`); v != 1 {
		t.Fatalf("capture_divert error count = %v, want 1", v)
	}
	// aetherctl pods / pod show the state.
	var out bytes.Buffer
	if err := ctl.RunPods(ctxT(t, 10*time.Second), []string{"--admin-socket", a.admin}, &out); err != nil {
		t.Fatalf("aetherctl pods: %v", err)
	}
	want := regexp.MustCompile(`(?m)^shop\s+web-1\s+cid-web-1\s+yes\s+pod label, at ADD\s+\d{4}-\d\d-\d\dT\S+Z\s+no\s+yes\s+yes\s+10\.1\.0\.5,fd00::5\s+refused:not_csi$`)
	if !want.MatchString(out.String()) {
		t.Fatalf("aetherctl pods:\n%s", out.String())
	}
	out.Reset()
	if err := ctl.RunPod(ctxT(t, 10*time.Second), []string{"--admin-socket", a.admin, "shop/web-1"}, &out); err != nil {
		t.Fatalf("aetherctl pod: %v", err)
	}
	for _, w := range []string{`Uncaptured:\s+yes \(nft: no such table\)`, `Last total:\s+9ms`, `UDS socket:\s+refused:not_csi`, `UID:\s+uid-web-1`, `Terminating:\s+no`, `Enrolled:\s+pod label, at ADD`} {
		if !regexp.MustCompile(w).MatchString(out.String()) {
			t.Fatalf("aetherctl pod lacks %q:\n%s", w, out.String())
		}
	}
	if err := ctl.RunPod(ctxT(t, 10*time.Second), []string{"--admin-socket", a.admin, "shop/nobody"}, &out); err == nil || !strings.Contains(err.Error(), "no record") {
		t.Fatalf("aetherctl pod of unknown pod: %v", err)
	}
	if v := a.metric(t, `aether_agent_uds_refusals_total{reason="not_csi"}`); v < 1 {
		t.Fatalf("uds not_csi refusals = %v", v)
	}

	// Unknown container: OK and counted.
	if _, err := c.ReportAddResult(ctxT(t, 5*time.Second), &cniv1.ReportAddResultRequest{ContainerId: "cid-nobody"}); err != nil {
		t.Fatalf("ReportAddResult unknown: %v", err)
	}
	if v := a.metric(t, `aether_cni_operations_total{operation="report_add_result",result="unknown_container"}`); v != 1 {
		t.Fatalf("unknown container count = %v, want 1", v)
	}

	// Restart: everything comes back from disk, uncaptured included.
	a.terminate(t)
	a = startAgent(t, dir, "--pod-manifests", mdir, "--pod-manifests-interval", "50ms")
	c = a.client(t)
	got, err = c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-web-1"})
	if err != nil || !got.GetUncaptured() || got.GetPod().GetUid() != "uid-web-1" || !got.GetRegistered() {
		t.Fatalf("GetPod after restart = %v, %v", got, err)
	}

	// Terminating: a deletionTimestamp in the manifest deregisters the pod;
	// the record stays until RemovePod.
	writeManifest(t, mdir, "web.yaml", podYAML("shop", "web-1", "uid-web-1", true, "  deletionTimestamp: \"2026-11-29T00:00:00Z\"", ""))
	eventually(t, "web-1 terminating and deregistered", func() bool {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-web-1"})
		return err == nil && g.GetPod().GetTerminating() && !g.GetRegistered()
	})
	// RemovePod: record gone; removing again (or an unknown one) succeeds.
	// The DEL's plugin_timings are kept: aetherctl pod names them.
	for i := 0; i < 2; i++ {
		rr, err := c.RemovePod(ctxT(t, 5*time.Second), &cniv1.RemovePodRequest{
			Name: "web-1", Namespace: "shop", ContainerId: "cid-web-1",
			PluginTimings: &cniv1.PluginTimings{PreCall: durationpb.New(time.Duration(i+3) * time.Millisecond)},
		})
		if err != nil || rr.GetResult() != cniv1.RemovePodResponse_RESULT_SUCCESS {
			t.Fatalf("RemovePod #%d = %v, %v", i, rr, err)
		}
	}
	if _, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-web-1"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetPod after RemovePod: %v, want NotFound", err)
	}
	err = ctl.RunPod(ctxT(t, 10*time.Second), []string{"--admin-socket", a.admin, "shop/web-1"}, &out)
	if err == nil || !regexp.MustCompile(`no record of pod shop/web-1; its last DEL: container cid-web-1 at \S+, pre call 4ms$`).MatchString(err.Error()) {
		t.Fatalf("aetherctl pod after DEL = %v, want no record naming the last DEL (pre call 4ms)", err)
	}
	a.terminate(t)
}
