package kubernetes_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/runtime/serializer"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"aether.io/node/deploy/chart"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
	"aether.io/node/tools/image/oci"
)

const (
	// imageRepo is the lane's image name; tags tell rollouts apart.
	imageRepo = "localhost/aether-node"
	// daemonSetName is the chart's DaemonSet (release aether-node).
	daemonSetName = "aether-node"
)

// install holds what installing aether-node put on the node.
type install struct {
	objects []runtime.Object
	runDir  string // hostPaths.runDir: agent sockets, pins, UDS root
	state   string // hostPaths.stateDir: agent store, installer state
}

// agentSocketDir is where the agent serves its private sockets (cni.sock,
// admin.sock; 0700, its own).
func (in *install) agentSocketDir() string { return filepath.Join(in.runDir, "agent") }

// proxySocketDir is where the agent serves the sockets aether-proxy
// consumes (xds.sock, lds.sock, workload.sock) and the Workload API token
// (0700; the only directory of runDir the proxy mounts).
func (in *install) proxySocketDir() string { return filepath.Join(in.runDir, "proxy") }

// buildImage builds the release binaries and the image `make image` writes
// (tools/image), and imports it into containerd's k8s.io namespace under
// every tag given, on every node given.
func buildImage(t *testing.T, nodes []*node, tags ...string) {
	t.Helper()
	own := harness.BuildOwn(t, oci.Binaries...)
	out := t.TempDir()
	for _, tag := range tags {
		cmd := exec.Command("go", "run", "./tools/image", "-bin", own, "-out", out, "-ref", imageRepo+":"+tag)
		cmd.Dir = harness.ModuleRoot()
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("failed to build the image with tools/image: %v\n%s", err, b)
		}
		for _, n := range nodes {
			n.runtime.Import(t, filepath.Join(out, "aether-node.tar"))
		}
	}
}

// installAetherNode renders the Helm chart (deploy/chart) with the lane's
// values (the image under tag, pull policy Never, every host path in the
// lane's directory: the CNI dirs of the lane's containerd, the kubelet's
// root dir, and the run and state dirs, which the chart mounts at the same
// path in the containers, so the paths aether-cni gets from the conflist
// are the ones the agent and the proxy see) and creates its objects in a
// new aether-system namespace, with the DaemonSet adapted where the chart
// has no value: the pods reach the API server on the node's loopback (no
// kube-proxy: the Service IP does not route).
func installAetherNode(t *testing.T, n *node, tag string) *install {
	t.Helper()
	in := &install{runDir: n.hostPath("run/aether"), state: n.hostPath("var/lib/aether")}
	mkdir(t, in.runDir, in.state)
	sharedMount(t, in.runDir)
	values := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(values, []byte(laneValues(tag, in.runDir, in.state, n.cniBin, n.runtime.ConfDir(), n.kubeletRoot)+`cni:
  pluginLogLevel: debug
  # Plaintext inbound reaches the managed pods' proxies, so policy and
  # PeerAuthentication decide it too (the AuthorizationPolicy scenario).
  inboundCapture: true
logLevel: debug
# aether-csi registers itself with the lane's kubelet (csi.registrar
# builtin, the default) under its root dir.
csi:
  enabled: true
# The embedded SPIFFE provider with a CA the chart generates: the agent
# issues the managed pods' SVIDs, every managed pod gets its HBONE
# listener on :15008 and WDS serves it tunnel_protocol HBONE.
identity:
  enabled: true
  generateCA: true
# Istio's AuthorizationPolicy and PeerAuthentication CRDs, as the chart
# installs them on a cluster without Istio (helm template sees no cluster).
policy:
  installCRDs: auto
# The scrape configuration Debian's Prometheus runs in the Prometheus
# scenario, and the dashboard whose queries it answers.
metrics:
  scrapeConfig:
    enabled: true
  dashboard:
    enabled: true
`), 0o600); err != nil {
		t.Fatal(err)
	}
	in.objects = createChart(t, n.cluster, values, func(ds *appsv1.DaemonSet) { adaptDaemonSet(t, n, ds) })
	return in
}

// createChart renders the chart with the values file, lets adapt change
// the DaemonSet (nil: unchanged) and creates the objects in a new
// aether-system namespace; it returns them, the namespace first.
func createChart(t *testing.T, c *kubetest.Cluster, values string, adapt func(*appsv1.DaemonSet)) []runtime.Object {
	t.Helper()
	ctx := context.Background()
	raw, err := chart.Render(ctx, values)
	if err != nil {
		t.Fatalf("failed to render the chart: %v", err)
	}
	objects := []runtime.Object{&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chart.Namespace}}}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, _, err := laneCodecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("failed to decode the rendered chart: %v\n%s", err, doc)
		}
		if ds, ok := obj.(*appsv1.DaemonSet); ok && adapt != nil {
			adapt(ds)
		}
		objects = append(objects, obj)
	}
	cs := c.Client
	for _, obj := range objects {
		var err error
		switch o := obj.(type) {
		case *corev1.Namespace:
			_, err = cs.CoreV1().Namespaces().Create(ctx, o, metav1.CreateOptions{})
		case *corev1.ServiceAccount:
			_, err = cs.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *corev1.Secret:
			_, err = cs.CoreV1().Secrets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *corev1.ConfigMap:
			_, err = cs.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = cs.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = cs.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.Role:
			_, err = cs.RbacV1().Roles(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.RoleBinding:
			_, err = cs.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *appsv1.DaemonSet:
			_, err = cs.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *storagev1.CSIDriver:
			_, err = cs.StorageV1().CSIDrivers().Create(ctx, o, metav1.CreateOptions{})
		case *admissionv1.ValidatingAdmissionPolicy:
			// The node patch policy: the agent's taint removal below goes
			// through it with the token kubelet projects into its pod.
			_, err = cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, o, metav1.CreateOptions{})
		case *admissionv1.ValidatingAdmissionPolicyBinding:
			_, err = cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, o, metav1.CreateOptions{})
		case *apiextensionsv1.CustomResourceDefinition:
			// Istio's security CRDs (kept on uninstall, as helm keeps them).
			var ext apiextensionsclient.Interface
			if ext, err = apiextensionsclient.NewForConfig(c.Config); err == nil {
				_, err = ext.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, o, metav1.CreateOptions{})
			}
		default:
			t.Fatalf("the chart renders a %T the lane does not install", obj)
		}
		if err != nil {
			t.Fatalf("failed to create %T: %v", obj, err)
		}
	}
	return objects
}

// laneValues are the values every lane sets: the image under tag (never
// pulled) and the chart's host paths.
func laneValues(tag, runDir, stateDir, cniBin, cniConf, kubeletDir string) string {
	return fmt.Sprintf(`image:
  repository: %s
  tag: %s
  pullPolicy: Never
hostPaths:
  runDir: %s
  stateDir: %s
  cniBinDir: %s
  cniConfDir: %s
  kubeletDir: %s
`, imageRepo, tag, runDir, stateDir, cniBin, cniConf, kubeletDir)
}

// laneCodecs decode the render: client-go's kinds plus the
// CustomResourceDefinition.
var laneCodecs = func() serializer.CodecFactory {
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := apiextensionsv1.AddToScheme(s); err != nil {
		panic(err)
	}
	return serializer.NewCodecFactory(s)
}()

// adaptDaemonSet sets what the chart has no value for and the lane needs
// (see installAetherNode).
func adaptDaemonSet(t *testing.T, n *node, ds *appsv1.DaemonSet) {
	t.Helper()
	for _, c := range allContainers(&ds.Spec.Template.Spec) {
		c.Env = append(c.Env,
			corev1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: "127.0.0.1"},
			corev1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: strconv.Itoa(n.cluster.Port)})
	}
}

// allContainers returns the pod's init containers (the installer is a
// native sidecar) and containers.
func allContainers(spec *corev1.PodSpec) []*corev1.Container {
	var cs []*corev1.Container
	for i := range spec.InitContainers {
		cs = append(cs, &spec.InitContainers[i])
	}
	for i := range spec.Containers {
		cs = append(cs, &spec.Containers[i])
	}
	return cs
}

// sharedMount makes dir a shared mount point (a bind mount onto itself),
// so the containers' HostToContainer mounts see aether-cni's netns pins;
// the root mount of these machines is private. Unmounted in tb.Cleanup.
func sharedMount(tb testing.TB, dir string) {
	tb.Helper()
	if err := syscall.Mount(dir, dir, "", syscall.MS_BIND, ""); err != nil {
		tb.Fatalf("failed to bind-mount %q: %v", dir, err)
	}
	tb.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	if err := syscall.Mount("", dir, "", syscall.MS_SHARED, ""); err != nil {
		tb.Fatalf("failed to make %q shared: %v", dir, err)
	}
}

// waitDaemonSetReady waits until every desired pod of the DaemonSet is
// updated and ready.
func waitDaemonSetReady(t *testing.T, n *node, d time.Duration) *appsv1.DaemonSet {
	t.Helper()
	return waitDaemonSetPods(t, n.cluster, n.kubelet, 1, d)
}

// waitDaemonSetPods waits until want pods of the DaemonSet are updated and
// ready (failing early when p exits).
func waitDaemonSetPods(t *testing.T, c *kubetest.Cluster, p *kubetest.Proc, want int32, d time.Duration) *appsv1.DaemonSet {
	t.Helper()
	var ds *appsv1.DaemonSet
	kubetest.WaitFor(t, "DaemonSet "+daemonSetName+" ready", d, p, func() bool {
		var err error
		ds, err = c.Client.AppsV1().DaemonSets(chart.Namespace).Get(context.Background(), daemonSetName, metav1.GetOptions{})
		if err != nil {
			return false
		}
		s := ds.Status
		return s.ObservedGeneration == ds.Generation && s.DesiredNumberScheduled == want &&
			s.NumberReady == want && s.UpdatedNumberScheduled == want && s.NumberAvailable == want
	})
	return ds
}

// uninstall deletes the installed objects (DaemonSet first, its pods with
// it) and waits until its pods are gone.
func (in *install) uninstall(t *testing.T, n *node) {
	t.Helper()
	ctx := context.Background()
	cs := n.cluster.Client
	fg := metav1.DeletePropagationForeground
	opts := metav1.DeleteOptions{PropagationPolicy: &fg}
	for i := len(in.objects) - 1; i >= 0; i-- {
		var err error
		switch o := in.objects[i].(type) {
		case *appsv1.DaemonSet:
			err = cs.AppsV1().DaemonSets(o.Namespace).Delete(ctx, o.Name, opts)
		case *storagev1.CSIDriver:
			err = cs.StorageV1().CSIDrivers().Delete(ctx, o.Name, opts)
		case *rbacv1.ClusterRoleBinding:
			err = cs.RbacV1().ClusterRoleBindings().Delete(ctx, o.Name, opts)
		case *rbacv1.RoleBinding:
			err = cs.RbacV1().RoleBindings(o.Namespace).Delete(ctx, o.Name, opts)
		case *rbacv1.Role:
			err = cs.RbacV1().Roles(o.Namespace).Delete(ctx, o.Name, opts)
		case *rbacv1.ClusterRole:
			err = cs.RbacV1().ClusterRoles().Delete(ctx, o.Name, opts)
		case *corev1.ServiceAccount:
			err = cs.CoreV1().ServiceAccounts(o.Namespace).Delete(ctx, o.Name, opts)
		case *corev1.Secret:
			err = cs.CoreV1().Secrets(o.Namespace).Delete(ctx, o.Name, opts)
		case *corev1.ConfigMap:
			err = cs.CoreV1().ConfigMaps(o.Namespace).Delete(ctx, o.Name, opts)
		case *admissionv1.ValidatingAdmissionPolicyBinding:
			err = cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(ctx, o.Name, opts)
		case *admissionv1.ValidatingAdmissionPolicy:
			err = cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(ctx, o.Name, opts)
		case *corev1.Namespace:
			// Deleted last, after its pods are gone (below).
			continue
		}
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("failed to delete %T: %v", in.objects[i], err)
		}
	}
	kubetest.WaitFor(t, "aether-node pods gone", 90*time.Second, n.kubelet, func() bool {
		l, err := cs.CoreV1().Pods(chart.Namespace).List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0
	})
}

// setImage rolls the DaemonSet to the image tag (every container).
func setImage(t *testing.T, n *node, tag string) {
	t.Helper()
	ctx := context.Background()
	dss := n.cluster.Client.AppsV1().DaemonSets(chart.Namespace)
	ds, err := dss.Get(ctx, daemonSetName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range allContainers(&ds.Spec.Template.Spec) {
		c.Image = imageRepo + ":" + tag
	}
	if _, err := dss.Update(ctx, ds, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("failed to roll the DaemonSet to %s: %v", tag, err)
	}
}

// chainGaps describes the samples of the conflist without aether-cni.
type chainGaps struct {
	samples, count     int
	unchained, longest time.Duration
	readErr            error
}

func (g chainGaps) String() string {
	return fmt.Sprintf("%d samples, %d gap(s) without aether-cni, %s unchained in all, longest %s, read error %v",
		g.samples, g.count, g.unchained.Round(time.Millisecond), g.longest.Round(time.Millisecond), g.readErr)
}

// watchChain samples the conflist every 10 ms until the returned function
// is called; that function stops the sampling and returns the gaps in
// which aether-cni was not chained.
func watchChain(t *testing.T, conflist string) func() chainGaps {
	t.Helper()
	stop, done := make(chan struct{}), make(chan chainGaps, 1)
	go func() {
		var (
			g        chainGaps
			gapStart time.Time
			last     = time.Now()
			ticker   = time.NewTicker(10 * time.Millisecond)
		)
		defer ticker.Stop()
		endGap := func(at time.Time) {
			g.count++
			g.unchained += at.Sub(gapStart)
			g.longest = max(g.longest, at.Sub(gapStart))
			gapStart = time.Time{}
		}
		for {
			select {
			case <-stop:
				if !gapStart.IsZero() {
					endGap(last)
				}
				done <- g
				return
			case now := <-ticker.C:
				g.samples++
				last = now
				b, err := os.ReadFile(conflist)
				if err != nil {
					g.readErr = err
				}
				chained := err == nil && bytes.Contains(b, []byte(`"aether-cni"`))
				switch {
				case !chained && gapStart.IsZero():
					gapStart = now
				case chained && !gapStart.IsZero():
					endGap(now)
				}
			}
		}
	}()
	var (
		once   sync.Once
		result chainGaps
	)
	stopFn := func() chainGaps {
		once.Do(func() { close(stop); result = <-done })
		return result
	}
	t.Cleanup(func() { stopFn() })
	return stopFn
}
