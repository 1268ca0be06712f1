package kubernetes_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/agent/uds"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/test/kubetest"
	workloadclient "aether.io/node/xds/workload/client"
)

const (
	// udsVolume is the inline csi.aether.io volume of the UDS pods,
	// mounted at udsMount; the app's socket is udsFile in it.
	udsVolume = "mesh"
	udsMount  = "/mesh"
	udsFile   = "app.sock"
	// udsGreeting is the line the UDS pods' app writes first on every
	// connection of its unix socket, never on its TCP port: a connection
	// to the pod's IP that reads it was delivered through the socket.
	udsGreeting = "hello from the app's unix socket"
	// agentHTTP is aether-agent's /metrics (the chart's --http-addr), on
	// the node's loopback.
	agentHTTP = "127.0.0.1:15029"
)

// udsPod is a managed bare pod running echo, also listening on
// udsMount/udsFile, with the annotation endpoint.aether.io/uds-socket =
// <annotated>/app.sock and the given volumes (all mounted under /v/<name>,
// the first at udsMount).
func udsPod(name, annotated string, volumes ...corev1.Volume) *corev1.Pod {
	zero := int64(0)
	var mounts []corev1.VolumeMount
	for i, v := range volumes {
		path := "/v/" + v.Name
		if i == 0 {
			path = udsMount
		}
		mounts = append(mounts, corev1.VolumeMount{Name: v.Name, MountPath: path})
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: appNamespace,
			Labels:      map[string]string{"app": name, "aether.io/managed": "true"},
			Annotations: map[string]string{uds.Annotation: annotated + "/" + udsFile},
		},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &zero,
			Volumes:                       volumes,
			Containers: []corev1.Container{{
				Name: "echo", Image: echoImage, ImagePullPolicy: corev1.PullNever,
				Args:         []string{"-unix", udsMount + "/" + udsFile, "-unix-greeting", udsGreeting},
				Ports:        []corev1.ContainerPort{{ContainerPort: echoPort}},
				VolumeMounts: mounts,
			}},
		},
	}
}

// csiVolume is an inline csi.aether.io volume.
func csiVolume(name string) corev1.Volume {
	return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: meshcontract.CSIDriver}}}
}

// testUDSSocket walks issue 14 item 3 on the real kubelet: aether-csi
// registered itself (the CSINode lists csi.aether.io), kubelet published
// the inline volume of a pod whose app listens on the annotated socket,
// the agent resolves <uds-csi-root>/<uid>/app.sock (aetherctl pod) where
// the socket is and answers, and again after the agent restarts; the
// client pod's connection to the pod's IP and app port travels over HBONE
// and reaches the app through that socket (meshToUDS), also with the API
// server down, and over TCP once the socket is gone (uds_fallback); WDS
// serves the pod the same (locality included) before and after the
// restarts; the two refused shapes show their reason in aetherctl pod and
// in the agent's metrics; deleting the pod unpublishes the volume and
// removes the pod dir.
func testUDSSocket(t *testing.T, n *node, in *install) {
	ctx := context.Background()
	pods := n.cluster.Client.CoreV1().Pods(appNamespace)
	csiNode, err := n.cluster.Client.StorageV1().CSINodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil || !slices.ContainsFunc(csiNode.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == meshcontract.CSIDriver }) {
		t.Fatalf("CSINode %s does not list %s (aether-csi's built-in registration): %+v, %v", nodeName, meshcontract.CSIDriver, csiNode, err)
	}
	empty := corev1.Volume{Name: "scratch", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}
	want := map[string]string{ // pod -> refusal reason ("" resolves)
		"uds":      "",
		"twice":    uds.ReasonMultipleCSIVolumes,
		"emptydir": uds.ReasonNotCSI,
	}
	created := time.Now()
	for _, p := range []*corev1.Pod{
		udsPod("uds", udsVolume, csiVolume(udsVolume)),
		udsPod("twice", udsVolume, csiVolume(udsVolume), csiVolume("mesh2")),
		udsPod("emptydir", empty.Name, empty),
	} {
		if _, err := pods.Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatalf("failed to create pod %s: %v", p.Name, err)
		}
	}
	running := map[string]corev1.Pod{}
	for name := range want {
		running[name] = runningPods(t, n, name, 1, 60*time.Second)[0]
	}
	p := running["uds"]
	sock := filepath.Join(in.runDir, "uds", string(p.UID), udsFile)

	// checkRecords checks aetherctl pod for every pod: the resolved path
	// (the app's socket there answers) or the refusal.
	checkRecords := func(when string) {
		t.Helper()
		for name, reason := range want {
			shown := sock
			if reason != "" {
				shown = "refused:" + reason
			}
			rec := agentPod(t, in, name)
			if rec.UID != string(running[name].UID) || rec.UDSRefusal != reason || (reason == "" && rec.UDSPath != sock) || (reason != "" && rec.UDSPath != "") {
				t.Errorf("%s: aetherctl pod %s: uid %s, uds path %q, refusal %q; want uid %s and %s", when, name, rec.UID, rec.UDSPath, rec.UDSRefusal, running[name].UID, shown)
			}
			table := string(aetherctl(t, "pod", "--admin-socket", filepath.Join(in.agentSocketDir(), "admin.sock"), appNamespace+"/"+name))
			if !strings.Contains(table, "UDS socket:") || !strings.Contains(table, shown) {
				t.Errorf("%s: aetherctl pod %s/%s does not show %s:\n%s", when, appNamespace, name, shown, table)
			}
		}
		echoUnix(t, sock)
		// aether-proxy got the path in the pod's listener metadata
		// (uds_socket), where inbound delivery will connect.
		kubetest.WaitFor(t, "aether-proxy /debug/pods to show the uds pod's socket "+sock, 20*time.Second, n.kubelet, func() bool {
			return proxyUDSSocket(t, n, "uds") == sock
		})
	}
	t.Logf("pods running in %s", time.Since(created).Round(time.Millisecond))
	checkRecords("after the pods started")
	// The client Deployment's pod (managed, captured) connects to the uds
	// pod's IP and app port: captured, tunnelled over HBONE to the pod's
	// :15008, delivered by the proxy to the unix socket.
	client := runningPods(t, n, "client", 1, 10*time.Second)[0]
	meshToUDS(t, n, client, p, telemetry.ViaUDS)
	// What WDS serves for the pod, which every restart below must keep:
	// the Node's locality (its topology labels) and HBONE.
	wds := wdsWorkload(t, in, "uds")
	wantLoc := &workloadpb.Locality{Region: nodeRegion, Zone: nodeZone, Subzone: nodeSubzone}
	if !proto.Equal(wds.GetLocality(), wantLoc) || wds.GetTunnelProtocol() != workloadpb.TunnelProtocol_HBONE {
		t.Errorf("WDS workload of uds: locality %v, tunnel %v; want %v (the Node's labels) and HBONE", wds.GetLocality(), wds.GetTunnelProtocol(), wantLoc)
	}
	sameWDS := func(when string) {
		t.Helper()
		if got := wdsWorkload(t, in, "uds"); !proto.Equal(got, wds) {
			t.Errorf("%s: WDS serves uds as\n%s\nwant what it served after the pod started:\n%s", when, protojson.Format(got), protojson.Format(wds))
		}
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("the app's socket on the host %s: %v, %v; want a socket", sock, fi, err)
	}
	m := agentMetrics(t, n)
	for _, reason := range []string{uds.ReasonMultipleCSIVolumes, uds.ReasonNotCSI} {
		line := metricLine(m, "aether_agent_uds_refusals_total", `reason="`+reason+`"`)
		if v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64); line == "" || err != nil || v < 1 {
			t.Errorf("agent metrics: %q, want aether_agent_uds_refusals_total{reason=%q} >= 1", line, reason)
		}
	}

	// The agent restarts (its container stopped through CRI; kubelet
	// starts it again) and resolves the same path from its stored records.
	restartAgent(t, n, in)
	checkRecords("after the agent restarted")
	sameWDS("after the agent restarted")

	// The same with the API server down: the agent restarts with no pod
	// source and serves every record (and the proxy its listener, the
	// agent the pods' SVIDs) from its store; then the API server comes
	// back and the agent syncs.
	apiDown := true
	restartAgentAPIDown(t, n, in, func() {
		when := "with the API server up again"
		if apiDown {
			when = "with the API server down"
		}
		checkRecords(when)
		sameWDS(when)
		if apiDown {
			meshToUDS(t, n, client, p, telemetry.ViaUDS)
			apiDown = false
		}
	})

	// The socket gone (the app's file removed): the destination proxy
	// logs the failure and delivers over TCP to the app's port instead,
	// never dropping the connection.
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	meshToUDS(t, n, client, p, telemetry.ViaUDSFallback)

	// Deleting the pod: kubelet calls NodeUnpublishVolume, the driver
	// removes <uds-csi-root>/<uid>/.
	deleted := time.Now()
	for name := range want {
		if err := pods.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	podDir := filepath.Dir(sock)
	var dirGone time.Duration // when the driver had removed podDir
	kubetest.WaitFor(t, "pods deleted and "+podDir+" removed", 60*time.Second, n.kubelet, func() bool {
		if _, err := os.Lstat(podDir); !os.IsNotExist(err) {
			return false
		}
		if dirGone == 0 {
			dirGone = time.Since(deleted)
		}
		for name := range want {
			if _, err := pods.Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return false
			}
		}
		return true
	})
	t.Logf("pods deleted and %s removed in %s (the directory after %s)", podDir, time.Since(deleted).Round(time.Millisecond), dirGone.Round(time.Millisecond))
	for name := range want {
		if rec := findAgentPod(agentPods(t, in), name); rec != nil {
			t.Errorf("agent record of deleted pod %s left: %+v", name, rec)
		}
	}
}

// restartAgentAPIDown stops kube-apiserver, restarts the agent's
// container through CRI (kubelet restarts it from its local pod state, the
// API server being down), runs check, asserts the agent is live but not
// ready (/healthz 200, /readyz 503: no first pod-source sync) with its
// metrics served from the store, then starts kube-apiserver again and
// waits until the agent's /readyz passes (its pod source reconnected).
func restartAgentAPIDown(t *testing.T, n *node, in *install, check func()) {
	t.Helper()
	begin := time.Now()
	n.cluster.StopAPIServer(t)
	stopped := time.Since(begin)
	if _, err := n.cluster.Client.CoreV1().Pods(appNamespace).List(context.Background(), metav1.ListOptions{}); err == nil {
		t.Fatal("kube-apiserver still answers after StopAPIServer")
	}
	restartAgent(t, n, in)
	restarted := time.Since(begin)
	for _, l := range strings.Split(n.kubelet.Output(), "\n") {
		if strings.Contains(l, "back-off") && strings.Contains(l, "aether-agent") {
			t.Logf("kubelet: %s", l)
			break
		}
	}
	check()
	checked := time.Since(begin)

	if code, body := nodeFetch(t, n, "http://"+agentHTTP+"/healthz"); code != 200 {
		t.Errorf("agent /healthz with the API server down: %d %q, want 200 (kubelet's liveness probe would restart it)", code, body)
	}
	if code, body := nodeFetch(t, n, "http://"+agentHTTP+"/readyz"); code != 503 {
		t.Errorf("agent /readyz with the API server down: %d %q, want 503 (no first pod-source sync yet)", code, body)
	} else {
		t.Logf("agent /readyz with the API server down: %d %s", code, strings.TrimSpace(string(body)))
	}
	m := agentMetrics(t, n)
	line := metricLine(m, "aether_agent_pods", `state="stored"`)
	if v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64); line == "" || err != nil || v < 3 {
		t.Errorf("agent metrics with the API server down: %q, want aether_agent_pods{state=\"stored\"} >= 3 (replayed records)", line)
	}
	for _, reason := range []string{uds.ReasonMultipleCSIVolumes, uds.ReasonNotCSI} {
		t.Logf("agent metrics with the API server down: %s", metricLine(m, "aether_agent_uds_refusals_total", `reason="`+reason+`"`))
	}
	down := time.Since(begin)

	up := n.cluster.StartAPIServer(t)
	start := time.Now()
	kubetest.WaitFor(t, "the agent's /readyz after kube-apiserver restarted", 90*time.Second, n.kubelet, func() bool {
		code, _ := nodeFetch(t, n, "http://"+agentHTTP+"/readyz")
		return code == 200
	})
	ready := time.Since(start)
	check()
	t.Logf("API server stopped in %s, agent restarted at %s, records checked at %s, down for %s; back in %s, agent ready %s later; step took %s",
		stopped.Round(time.Millisecond), restarted.Round(time.Millisecond), checked.Round(time.Millisecond), down.Round(time.Millisecond),
		up.Round(time.Millisecond), ready.Round(time.Millisecond), time.Since(begin).Round(time.Millisecond))
}

// agentPod is `aetherctl pod <namespace>/<name> -o json` for a pod with
// one record.
func agentPod(t *testing.T, in *install, name string) adminapi.Pod {
	t.Helper()
	var recs []adminapi.Pod
	out := aetherctl(t, "pod", "--admin-socket", filepath.Join(in.agentSocketDir(), "admin.sock"), "-o", "json", appNamespace+"/"+name)
	if err := json.Unmarshal(out, &recs); err != nil {
		t.Fatalf("aetherctl pod %s/%s -o json printed %q: %v", appNamespace, name, out, err)
	}
	if len(recs) != 1 {
		t.Fatalf("aetherctl pod %s/%s: %d records, want 1: %+v", appNamespace, name, len(recs), recs)
	}
	return recs[0]
}

// echoUnix dials the unix socket at path, sends a line and checks that
// the app's greeting and then the line come back (the app answers through
// the published volume).
func echoUnix(t *testing.T, path string) {
	t.Helper()
	c, err := net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		t.Fatalf("failed to dial the app's socket %s: %v", path, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	const msg = "hello over the uds volume\n"
	if _, err := io.WriteString(c, msg); err != nil {
		t.Fatalf("failed to write to %s: %v", path, err)
	}
	r := bufio.NewReader(c)
	if got, err := r.ReadString('\n'); err != nil || got != udsGreeting+"\n" {
		t.Fatalf("first line over %s = %q, %v; want the app's greeting %q", path, got, err, udsGreeting)
	}
	if got, err := r.ReadString('\n'); err != nil || got != msg {
		t.Fatalf("echo over %s = %q, %v; want %q", path, got, err, msg)
	}
}

// meshToUDS connects from the client pod's netns to the dst pod's IP and
// app port, as the app would: the client's proxy captures it and tunnels
// it over HBONE to dst's :15008, where the proxy delivers it (via: uds, to
// the pod's unix socket; uds_fallback, over TCP after the socket failed).
// It checks the bytes took that path: the app's greeting comes first
// exactly when they went through the socket, the destination proxy counted
// one more aether_inbound_deliveries_total{via}, and an inbound connection
// from the client's verified SPIFFE ID to dst. A reset attempt (the proxy
// not holding the client's SVID yet, right after a restart) is retried
// within a bounded deadline.
func meshToUDS(t *testing.T, n *node, client, dst corev1.Pod, via string) {
	t.Helper()
	before := metricValue(proxyMetrics(t, n), "aether_inbound_deliveries_total", `via="`+via+`"`)
	addr := net.JoinHostPort(dst.Status.PodIP, strconv.Itoa(echoPort))
	const msg = "hello through the mesh to the app's socket\n"
	want := []string{msg}
	if via == telemetry.ViaUDS {
		want = []string{udsGreeting + "\n", msg}
	}
	netns, err := ns.GetNS(podNetns(t, n, client))
	if err != nil {
		t.Fatal(err)
	}
	defer netns.Close()
	var (
		got      []string
		lastErr  error
		attempts int
	)
	start := time.Now()
	try := func() bool {
		attempts++
		got, lastErr = nil, nil
		var c net.Conn
		if lastErr = netns.Do(func(ns.NetNS) error {
			var err error
			c, err = (&net.Dialer{Timeout: 5 * time.Second}).Dial("tcp", addr)
			return err
		}); lastErr != nil {
			return false
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, lastErr = io.WriteString(c, msg); lastErr != nil {
			return false
		}
		r := bufio.NewReader(c)
		for range want {
			var l string
			if l, lastErr = r.ReadString('\n'); lastErr != nil {
				return false
			}
			got = append(got, l)
		}
		return true
	}
	for deadline := start.Add(20 * time.Second); !try(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no mesh connection %s -> %s within 20 s (%d attempts): last error %v after reading %q", client.Name, addr, attempts, lastErr, got)
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("mesh connection %s -> %s read %q, want %q (via %s)", client.Name, addr, got, want, via)
	}
	m := proxyMetrics(t, n)
	if after := metricValue(m, "aether_inbound_deliveries_total", `via="`+via+`"`); after < before+1 {
		t.Fatalf("aether_inbound_deliveries_total{via=%q} went from %v to %v, want one more:\n%s", via, before, after, m)
	}
	principal := "spiffe://cluster.local/ns/" + appNamespace + "/sa/default"
	line := metricLine(m, "istio_tcp_connections_opened_total", `reporter="destination"`, `connection_security_policy="mutual_tls"`, `source_principal="`+principal+`"`,
		`source_workload="client"`, `destination_workload="`+dst.Name+`"`)
	if line == "" {
		t.Fatalf("aether-proxy metrics have no inbound HBONE connection from %s to %s:\n%s", principal, dst.Name, m)
	}
	t.Logf("mesh %s -> %s delivered via %s in %s (%d attempt(s), last error %v): %s", client.Name, addr, via,
		time.Since(start).Round(time.Millisecond), attempts, lastErr, line)
}

// metricValue is the value of the first line of metric with every label
// given, 0 when there is none.
func metricValue(metrics, metric string, lbls ...string) float64 {
	line := metricLine(metrics, metric, lbls...)
	if line == "" {
		return 0
	}
	v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
	return v
}

// wdsWorkload is the workload the agent's WDS serves for the pod name (on
// its xds socket, as aether-proxy reads it), every field.
func wdsWorkload(t *testing.T, in *install, name string) *workloadpb.Workload {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := workloadclient.Dial(ctx, workloadclient.Options{Socket: filepath.Join(in.proxySocketDir(), "xds.sock"), NodeID: "kubernetes-lane"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Recv(); err != nil {
		t.Fatalf("failed to receive the agent's workloads: %v", err)
	}
	for _, w := range c.Workloads() {
		if w.GetNamespace() == appNamespace && w.GetName() == name {
			return w
		}
	}
	t.Fatalf("the agent's WDS serves no workload %s/%s", appNamespace, name)
	return nil
}

// agentMetrics returns aether-agent's /metrics text (from the node netns).
func agentMetrics(t *testing.T, n *node) string {
	t.Helper()
	return string(nodeGet(t, n, "http://"+agentHTTP+"/metrics"))
}

// proxyUDSSocket is the UDSSocket aether-proxy's /debug/pods shows for
// the pod name (empty when it shows none or does not serve the pod).
func proxyUDSSocket(t *testing.T, n *node, name string) string {
	t.Helper()
	var pods []struct{ Namespace, Name, UDSSocket string }
	if b := nodeGet(t, n, "http://"+proxyAdmin+"/debug/pods"); json.Unmarshal(b, &pods) != nil {
		t.Fatalf("aether-proxy /debug/pods does not decode: %s", b)
	}
	for _, p := range pods {
		if p.Namespace == appNamespace && p.Name == name {
			return p.UDSSocket
		}
	}
	return ""
}

// restartAgent stops the running aether-agent container through CRI and
// waits until kubelet runs a new one that answers aetherctl.
func restartAgent(t *testing.T, n *node, in *install) {
	t.Helper()
	ctx := context.Background()
	running := func() []*runtimeapi.Container {
		l, err := n.runtime.CRI.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{
			State:         &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING},
			LabelSelector: map[string]string{"io.kubernetes.container.name": "aether-agent"},
		}})
		if err != nil {
			t.Fatalf("failed to list the agent's containers: %v", err)
		}
		return l.GetContainers()
	}
	before := running()
	if len(before) != 1 {
		t.Fatalf("running aether-agent containers: %d, want 1", len(before))
	}
	if _, err := n.runtime.CRI.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: before[0].GetId(), Timeout: 10}); err != nil {
		t.Fatalf("failed to stop the agent's container: %v", err)
	}
	start := time.Now()
	var created time.Duration // until kubelet ran the new container
	kubetest.WaitFor(t, "a new aether-agent container answering", 60*time.Second, n.kubelet, func() bool {
		now := running()
		if len(now) != 1 || now[0].GetId() == before[0].GetId() {
			return false
		}
		if created == 0 {
			created = time.Since(start)
		}
		_, err := adminapi.NewClient(filepath.Join(in.agentSocketDir(), "admin.sock")).Pod(ctx, appNamespace, "uds")
		return err == nil
	})
	t.Logf("agent restarted and answering in %s (new container running after %s)", time.Since(start).Round(time.Millisecond), created.Round(time.Millisecond))
}
