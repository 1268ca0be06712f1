package kubernetes_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/pkg/readiness"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
	workloadclient "aether.io/node/xds/workload/client"
)

const (
	// appNamespace holds the lane's workloads (not a system namespace).
	appNamespace = "shop"
	// echoImage is test/kubernetes/echo packed as an image.
	echoImage = "localhost/echo:lane"
	echoPort  = 8080
	// proxyAdmin is aether-proxy's /metrics (deploy's -admin-address), on
	// the node's loopback.
	proxyAdmin = "127.0.0.1:18090"
)

// deployEcho creates a one-replica Deployment of the echo server, managed
// (label aether.io/managed=true on its pods) or not.
func deployEcho(t *testing.T, n *node, name string, managed bool) {
	t.Helper()
	d := echoDeployment(appNamespace, name, managed, 1)
	if _, err := n.cluster.Client.AppsV1().Deployments(appNamespace).Create(context.Background(), d, metav1.CreateOptions{}); err != nil {
		t.Fatalf("failed to create deployment %s/%s: %v", appNamespace, name, err)
	}
}

// echoDeployment is a Deployment of the echo server in namespace ns.
func echoDeployment(ns, name string, managed bool, replicas int32) *appsv1.Deployment {
	podLabels := map[string]string{"app": name}
	if managed {
		podLabels["aether.io/managed"] = "true"
	}
	grace := int64(1)
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: &grace,
					Containers: []corev1.Container{{
						Name: "echo", Image: echoImage, ImagePullPolicy: corev1.PullNever,
						Ports: []corev1.ContainerPort{{ContainerPort: echoPort}},
					}},
				},
			},
		},
	}
}

// runningPods waits until the Deployment name has want Running pods with
// an IP and returns them.
func runningPods(t *testing.T, n *node, name string, want int, d time.Duration) []corev1.Pod {
	t.Helper()
	return runningPodsIn(t, n.cluster, n.kubelet, appNamespace, name, want, d)
}

// runningPodsIn is runningPods for namespace ns of cluster c (failing
// early when p exits).
func runningPodsIn(t *testing.T, c *kubetest.Cluster, p *kubetest.Proc, ns, name string, want int, d time.Duration) []corev1.Pod {
	t.Helper()
	var pods []corev1.Pod
	sel := labels.SelectorFromSet(map[string]string{"app": name}).String()
	kubetest.WaitFor(t, fmt.Sprintf("%d running pod(s) of %s", want, name), d, p, func() bool {
		l, err := c.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: sel})
		if err != nil {
			return false
		}
		pods = pods[:0]
		for _, p := range l.Items {
			if p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" && p.DeletionTimestamp == nil {
				pods = append(pods, p)
			}
		}
		return len(pods) == want
	})
	return pods
}

// aetherctl runs the aetherctl binary from this module against the
// agent's sockets on their host paths and returns its stdout.
func aetherctl(t *testing.T, args ...string) []byte {
	t.Helper()
	own := harness.BuildOwn(t, "aetherctl")
	cmd := exec.Command(filepath.Join(own, "aetherctl"), args...)
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = ee.Stderr
		}
		t.Fatalf("aetherctl %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
	}
	return out
}

// aetherctlJSON runs `aetherctl <args> -o json` and decodes its output.
func aetherctlJSON(t *testing.T, v any, args ...string) {
	t.Helper()
	out := aetherctl(t, append(args, "-o", "json")...)
	if err := json.Unmarshal(out, v); err != nil {
		t.Fatalf("aetherctl %s -o json printed %q: %v", strings.Join(args, " "), out, err)
	}
}

// agentPods is `aetherctl pods -o json`.
func agentPods(t *testing.T, in *install) []adminapi.Pod {
	t.Helper()
	var pods []adminapi.Pod
	aetherctlJSON(t, &pods, "pods", "--admin-socket", filepath.Join(in.agentSocketDir(), "admin.sock"))
	return pods
}

// workloads is `aetherctl workloads -o json`.
func workloads(t *testing.T, in *install) []workloadclient.Row {
	t.Helper()
	var rows []workloadclient.Row
	aetherctlJSON(t, &rows, "workloads", "--xds-socket", filepath.Join(in.proxySocketDir(), "xds.sock"))
	return rows
}

func findAgentPod(pods []adminapi.Pod, name string) *adminapi.Pod {
	for i := range pods {
		if pods[i].Namespace == appNamespace && pods[i].Name == name {
			return &pods[i]
		}
	}
	return nil
}

func findWorkload(rows []workloadclient.Row, name string) *workloadclient.Row {
	for i := range rows {
		if rows[i].Namespace == appNamespace && rows[i].Name == name {
			return &rows[i]
		}
	}
	return nil
}

// podNetns is the network namespace containerd gave the pod's sandbox.
func podNetns(t *testing.T, n *node, p corev1.Pod) string {
	t.Helper()
	l, err := n.runtime.CRI.ListPodSandbox(context.Background(), &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State:         &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": string(p.UID)},
	}})
	if err != nil || len(l.GetItems()) != 1 {
		t.Fatalf("ready sandboxes of pod %s: %v, %v", p.Name, l.GetItems(), err)
	}
	return n.runtime.SandboxNetns(t, l.GetItems()[0].GetId())
}

// captured reports whether the pod's netns holds the capture table.
func captured(t *testing.T, nsPath string) bool {
	t.Helper()
	ok, err := (capture.Installer{}).Present(nsPath)
	if err != nil {
		t.Fatalf("failed to look for the capture table in %s: %v", nsPath, err)
	}
	return ok
}

// proxyServing checks that aether-proxy serves the pod's listeners (its
// readiness endpoint inside the pod, as aether-cni probes it).
func proxyServing(t *testing.T, nsPath string) {
	t.Helper()
	url := fmt.Sprintf("http://127.0.0.1:%d%s", meshcontract.OutboundPort, meshcontract.ReadinessPath)
	if err := (readiness.Prober{}).Probe(context.Background(), nsPath, url, 20*time.Second); err != nil {
		t.Fatalf("aether-proxy does not serve the pod's listeners: %v", err)
	}
}

// echoFrom dials addr from inside the netns at nsPath, sends a line and
// checks it comes back.
func echoFrom(t *testing.T, nsPath, addr string) {
	t.Helper()
	if err := tryEcho(nsPath, addr); err != nil {
		t.Fatal(err)
	}
}

// tryEcho is echoFrom returning what went wrong.
func tryEcho(nsPath, addr string) error {
	netns, err := ns.GetNS(nsPath)
	if err != nil {
		return err
	}
	defer netns.Close()
	var c net.Conn
	err = netns.Do(func(ns.NetNS) error {
		var err error
		c, err = (&net.Dialer{Timeout: 5 * time.Second}).Dial("tcp", addr)
		return err
	})
	if err != nil {
		return fmt.Errorf("failed to dial %s from %s: %w", addr, nsPath, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	const msg = "hello through the mesh\n"
	if _, err := io.WriteString(c, msg); err != nil {
		return fmt.Errorf("failed to write to %s: %w", addr, err)
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return fmt.Errorf("echo from %s: %w", addr, err)
	}
	if got != msg {
		return fmt.Errorf("echo from %s = %q, want %q", addr, got, msg)
	}
	return nil
}

// proxyMetrics returns aether-proxy's /metrics text (from the node netns).
func proxyMetrics(t *testing.T, n *node) string {
	t.Helper()
	return string(nodeGet(t, n, "http://"+proxyAdmin+"/metrics"))
}

// nodeGet returns the body of a GET of url from the node netns (the
// admin endpoints on the node's loopback).
func nodeGet(t *testing.T, n *node, url string) []byte {
	t.Helper()
	_, b := nodeFetch(t, n, url)
	return b
}

// nodeFetch is nodeGet that also returns the HTTP status code.
func nodeFetch(t *testing.T, n *node, url string) (int, []byte) {
	t.Helper()
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: n.cluster.Dial}}
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatalf("failed to get %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("failed to read %s: %v", url, err)
	}
	return resp.StatusCode, b
}

// metricLine returns the first line of metric that has every label given.
func metricLine(metrics, metric string, lbls ...string) string {
	for _, l := range strings.Split(metrics, "\n") {
		if !strings.HasPrefix(l, metric+"{") {
			continue
		}
		all := true
		for _, want := range lbls {
			all = all && strings.Contains(l, want)
		}
		if all {
			return l
		}
	}
	return ""
}

// createNamespace creates the lane's application namespace.
func createNamespace(t *testing.T, n *node) {
	t.Helper()
	createNamespaceIn(t, n.cluster, n.kubelet, appNamespace)
}

// createNamespaceIn creates namespace ns and waits for its default
// ServiceAccount (failing early when p exits).
func createNamespaceIn(t *testing.T, c *kubetest.Cluster, p *kubetest.Proc, ns string) {
	t.Helper()
	_, err := c.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	// The controller-manager creates the default ServiceAccount.
	kubetest.WaitFor(t, "ServiceAccount "+ns+"/default", 30*time.Second, p, func() bool {
		_, err := c.Client.CoreV1().ServiceAccounts(ns).Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil
	})
}

// watchEvent is one line of `aetherctl workloads --watch -o json`.
type watchEvent struct {
	Event    string              `json:"event"`
	UID      string              `json:"uid"`
	Workload *workloadclient.Row `json:"workload"`
}

// watchWorkloads runs `aetherctl workloads --watch -o json` until the test
// ends and streams its events.
func watchWorkloads(t *testing.T, in *install) <-chan watchEvent {
	t.Helper()
	own := harness.BuildOwn(t, "aetherctl")
	cmd := exec.Command(filepath.Join(own, "aetherctl"), "workloads", "--watch", "-o", "json",
		"--xds-socket", filepath.Join(in.proxySocketDir(), "xds.sock"))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("failed to start aetherctl workloads --watch: %v", err)
	}
	events := make(chan watchEvent, 256)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(events)
		dec := json.NewDecoder(out)
		for {
			var e watchEvent
			if err := dec.Decode(&e); err != nil {
				return
			}
			events <- e
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		for range events { // drain, so the reader ends
		}
		<-done
		_ = cmd.Wait()
	})
	return events
}

// nextEvent returns the first event that matches, failing after d.
func nextEvent(t *testing.T, events <-chan watchEvent, what string, d time.Duration, match func(watchEvent) bool) watchEvent {
	t.Helper()
	timeout := time.After(d)
	for {
		select {
		case e, ok := <-events:
			if !ok {
				t.Fatalf("aetherctl workloads --watch ended while waiting for %s", what)
			}
			if match(e) {
				return e
			}
		case <-timeout:
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
	}
}

// managedRecords maps the managed pods the agent stores (by pod name) to
// their uid.
func managedRecords(t *testing.T, in *install) map[string]string {
	t.Helper()
	recs := map[string]string{}
	for _, p := range agentPods(t, in) {
		if p.Managed && p.Namespace == appNamespace {
			recs[p.Name] = p.UID
		}
	}
	return recs
}

// sandboxRetries summarises kubelet's FailedCreatePodSandBox events of a
// pod (each one a sandbox ADD that failed and was retried, such as
// aether-cni's code 11 while the agent restarts).
func sandboxRetries(t *testing.T, n *node, p corev1.Pod) string {
	t.Helper()
	evs, err := n.cluster.Client.CoreV1().Events(p.Namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.name=" + p.Name + ",reason=FailedCreatePodSandBox",
	})
	if err != nil {
		t.Fatalf("failed to list the events of pod %s: %v", p.Name, err)
	}
	var count int32
	for _, e := range evs.Items {
		count += max(e.Count, 1)
	}
	if count == 0 {
		return "its sandbox started at the first attempt"
	}
	msg := evs.Items[0].Message
	if len(msg) > 300 {
		msg = msg[:300] + "..."
	}
	return fmt.Sprintf("kubelet retried its sandbox after %d failed attempt(s), first: %s", count, msg)
}
