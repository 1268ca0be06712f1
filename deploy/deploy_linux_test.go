package deploy_test

import (
	"bytes"
	"encoding/json"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"

	"aether.io/node/agent/app"
	"aether.io/node/agent/identity"
	"aether.io/node/agent/identity/identitytest"
	"aether.io/node/agent/nodegate"
	"aether.io/node/cniinstall"
	"aether.io/node/csi"
	"aether.io/node/deploy/chart"
	"aether.io/node/enivlan/config"
	"aether.io/node/meshcni"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/test/harness"
	"aether.io/node/tools/image/oci"
	workloadclient "aether.io/node/xds/workload/client"
)

// expand substitutes the downward-API variables kubelet expands in args.
func expand(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = strings.NewReplacer("$(NODE_NAME)", "node-1", "$(NODE_IP)", "192.0.2.10").Replace(a)
	}
	return out
}

func agentConfig(t *testing.T, r *render) *app.Config {
	t.Helper()
	var stderr bytes.Buffer
	cfg, err := app.ParseFlags(withTestCA(t, expand(container(t, r, "aether-agent").Args)), &stderr)
	if err != nil {
		t.Fatalf("aether-agent rejects the chart's args: %v\n%s", err, stderr.String())
	}
	return cfg
}

// withTestCA points --ca-cert and --ca-key, which name files of the
// identity Secret's mount, at a CA generated for the args' trust domain, so
// the agent's parser (which loads and validates the CA) accepts them.
func withTestCA(t *testing.T, args []string) []string {
	t.Helper()
	td := "cluster.local"
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--trust-domain="); ok {
			td = v
		}
	}
	var cert, key string
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = a
		flag, _, ok := strings.Cut(a, "=")
		if ok && flag == "--ca-trust-bundle" {
			other, _, _ := identitytest.CA(t, identitytest.Valid(td))
			f := filepath.Join(t.TempDir(), "bundle.pem")
			if err := os.WriteFile(f, other, 0o600); err != nil {
				t.Fatal(err)
			}
			out[i] = "--ca-trust-bundle=" + f
			continue
		}
		if !ok || (flag != "--ca-cert" && flag != "--ca-key") {
			continue
		}
		if cert == "" {
			cert, key = identitytest.Files(t, t.TempDir(), identitytest.Valid(td))
		}
		out[i] = map[string]string{"--ca-cert": "--ca-cert=" + cert, "--ca-key": "--ca-key=" + key}[flag]
	}
	return out
}

func installerOptions(t *testing.T, r *render) *cniinstall.Options {
	t.Helper()
	var stderr bytes.Buffer
	o, err := cniinstall.ParseFlags(container(t, r, "install-cni").Args, &stderr)
	if err != nil {
		t.Fatalf("aether-cni-install rejects the chart's args: %v\n%s", err, stderr.String())
	}
	return o
}

func TestAgentArgsParse(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		cfg := agentConfig(t, r)
		if cfg.NodeName != "node-1" || cfg.XDSSocket == "" || cfg.LDSSocket == "" {
			t.Fatalf("unexpected agent config %+v", cfg)
		}
		if !slices.Contains(cfg.SystemNamespaces, chart.Namespace) {
			t.Errorf("system namespaces %q lack the release namespace %s", cfg.SystemNamespaces, chart.Namespace)
		}
		if cfg.PodManifests != "" {
			t.Error("the chart must use the Kubernetes pod source, not --pod-manifests")
		}
		env := envVars(container(t, r, "aether-agent"))
		if env["NODE_NAME"] != "spec.nodeName" {
			t.Errorf("aether-agent env NODE_NAME from %q, want the downward API spec.nodeName", env["NODE_NAME"])
		}
	})
}

// TestValuesReachTheBinaries checks each value set's values arrive in the
// parsed configurations of the agent and the installer.
func TestValuesReachTheBinaries(t *testing.T) {
	t.Run("default", func(t *testing.T) {
		r := renderSet(t, valueSets[0])
		cfg := agentConfig(t, r)
		if cfg.Registry != "kube" || cfg.ClusterID != "Kubernetes" || cfg.TrustDomain != "cluster.local" || cfg.LogLevel != "info" || !cfg.RemoveNotReadyTaint ||
			cfg.AmbientNamespaces {
			t.Errorf("agent config %+v: want the chart's defaults", cfg)
		}
		o := installerOptions(t, r)
		if !slices.Equal(o.Config.Binaries, []string{cniinstall.PluginType}) {
			t.Errorf("installer copies %q, want only aether-cni", o.Config.Binaries)
		}
		if r.ds.Spec.Template.Spec.PriorityClassName != "system-node-critical" {
			t.Errorf("priorityClassName %q, want system-node-critical", r.ds.Spec.Template.Spec.PriorityClassName)
		}
	})
	t.Run("observability", func(t *testing.T) {
		r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == "observability" })])
		cfg := agentConfig(t, r)
		if cfg.OTLPEndpoint != "otel-collector.monitoring:4317" || cfg.MetricsAddr != "[192.0.2.10]:25030" {
			t.Errorf("agent config: otlp endpoint %q, metrics address %q; want the set's collector and [node IP]:25030", cfg.OTLPEndpoint, cfg.MetricsAddr)
		}
		if cfg.HTTPAddr != "127.0.0.1:15029" {
			t.Errorf("agent --http-addr %q: health must stay on 127.0.0.1", cfg.HTTPAddr)
		}
	})
	t.Run("etcd-tls", func(t *testing.T) {
		r := renderSet(t, valueSets[1])
		cfg := agentConfig(t, r)
		if cfg.Registry != "etcd" || len(cfg.EtcdEndpoints) != 2 || cfg.EtcdInsecure || cfg.EtcdPrefix != "/aether/prod/" ||
			cfg.ClusterID != "prod-eu-1" || cfg.TrustDomain != "prod.example.com" {
			t.Errorf("agent config %+v: want etcd over TLS with the set's endpoints, prefix, cluster and trust domain", cfg)
		}
		if !slices.Contains(cfg.SystemNamespaces, "monitoring") {
			t.Errorf("system namespaces %q lack monitoring", cfg.SystemNamespaces)
		}
		if !cfg.AmbientNamespaces {
			t.Error("enrolment.ambientNamespaces: true did not reach the agent's --ambient-namespaces")
		}
		// Every TLS file is an item of the Secret volume, mounted read-only
		// in the agent, from the key the values name.
		keys := map[string]string{cfg.EtcdCAFile: "ca.pem", cfg.EtcdCertFile: "client.pem", cfg.EtcdKeyFile: "client-key.pem"}
		for file, key := range keys {
			m, v := mountOf(t, r, container(t, r, "aether-agent"), file)
			if v.Secret == nil || v.Secret.SecretName != "aether-etcd-client" || !m.ReadOnly {
				t.Errorf("%s: want a read-only mount of Secret aether-etcd-client, got volume %+v", file, v)
				continue
			}
			rel, _ := filepath.Rel(m.MountPath, file)
			if !slices.ContainsFunc(v.Secret.Items, func(i corev1.KeyToPath) bool { return i.Key == key && i.Path == rel }) {
				t.Errorf("%s: Secret items %+v do not map key %s to %s", file, v.Secret.Items, key, rel)
			}
		}
		if r.ds.Spec.Template.Spec.ImagePullSecrets[0].Name != "regcred" {
			t.Errorf("imagePullSecrets %+v, want regcred", r.ds.Spec.Template.Spec.ImagePullSecrets)
		}
		for _, c := range ownContainers(r) {
			if c.Image != "registry.example.com/aether/aether-node:v0.2.0" || c.ImagePullPolicy != corev1.PullAlways {
				t.Errorf("container %s image %q %s, want the set's image and pull policy", c.Name, c.Image, c.ImagePullPolicy)
			}
		}
	})
	t.Run("eni-vlan-debug", func(t *testing.T) {
		r := renderSet(t, valueSets[2])
		cfg := agentConfig(t, r)
		if cfg.LogLevel != "debug" || cfg.RemoveNotReadyTaint || cfg.PodWait.String() != "10s" {
			t.Errorf("agent config %+v: want debug, no node gating, the extra --pod-wait", cfg)
		}
		o := installerOptions(t, r)
		if !slices.Contains(o.Config.Binaries, cniinstall.EniVlanBinary) || o.LogLevel != "debug" {
			t.Errorf("installer %+v: want eni-vlan copied and debug logs", o)
		}
		var entry struct {
			LogLevel string `json:"log_level"`
		}
		if err := json.Unmarshal(o.Config.Entry, &entry); err != nil || entry.LogLevel != "debug" {
			t.Errorf("chained entry %s: want log_level debug (%v)", o.Config.Entry, err)
		}
		if !slices.Contains(container(t, r, "aether-proxy").Args, "-log-level=debug") {
			t.Error("aether-proxy does not get -log-level=debug")
		}
		if pc := r.ds.Spec.Template.Spec.PriorityClassName; pc != "" {
			t.Errorf("priorityClassName %q, want none", pc)
		}
	})
}

// TestIdentityValues checks the identity values: the CA Secret's files are
// mounted read-only into the agent at the paths of --ca-cert and --ca-key,
// --svid-ttl carries svidTTL, and the proxy watches the agent's Workload
// API socket; without identity neither binary gets an identity flag.
func TestIdentityValues(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		agent, proxy := container(t, r, "aether-agent"), container(t, r, "aether-proxy")
		if r.set.name != "identity" {
			for _, a := range append(slices.Clone(agent.Args), proxy.Args...) {
				if strings.Contains(a, "ca-cert") || strings.Contains(a, "workload-api-socket") {
					t.Errorf("embedded identity off but arg %q", a)
				}
				if r.set.name != "identity-spire" && (strings.Contains(a, "spire-admin-socket") || strings.Contains(a, "external-identities")) {
					t.Errorf("spire identity off but arg %q", a)
				}
			}
			return
		}
		cfg := agentConfig(t, r)
		proxyDir := filepath.Join(chartValues(t, r).HostPaths["runDir"], "proxy")
		if cfg.CA == nil || cfg.SVIDTTL != 2*time.Hour || filepath.Dir(cfg.WorkloadAPISocket) != proxyDir || cfg.TrustDomain != "mesh.example.com" {
			t.Errorf("agent config %+v: want the CA loaded, 2h SVIDs, the socket in %s, trust domain mesh.example.com", cfg, proxyDir)
		}
		if len(cfg.CAAnchors) != 1 {
			t.Errorf("agent trust anchors = %d, want the one of trustBundleConfigMap", len(cfg.CAAnchors))
		}
		for _, a := range agent.Args {
			if file, ok := strings.CutPrefix(a, "--ca-trust-bundle="); ok {
				m, v := mountOf(t, r, agent, file)
				rel, _ := filepath.Rel(m.MountPath, file)
				if v.ConfigMap == nil || v.ConfigMap.Name != "aether-identity-bundle" || !m.ReadOnly ||
					!slices.ContainsFunc(v.ConfigMap.Items, func(i corev1.KeyToPath) bool { return i.Key == "bundle.pem" && i.Path == rel }) {
					t.Errorf("%s: want a read-only mount of ConfigMap aether-identity-bundle key bundle.pem, got %+v", file, v)
				}
			}
		}
		if !slices.Contains(proxy.Args, "-workload-api-socket="+cfg.WorkloadAPISocket) {
			t.Errorf("aether-proxy args %q lack -workload-api-socket=%s", proxy.Args, cfg.WorkloadAPISocket)
		}
		for _, a := range agent.Args {
			flag, file, _ := strings.Cut(a, "=")
			if flag != "--ca-cert" && flag != "--ca-key" {
				continue
			}
			m, v := mountOf(t, r, agent, file)
			if v.Secret == nil || v.Secret.SecretName != "aether-identity-ca" || !m.ReadOnly {
				t.Errorf("%s: want a read-only mount of Secret aether-identity-ca, got volume %+v", file, v)
				continue
			}
			key := map[string]string{"--ca-cert": "tls.crt", "--ca-key": "tls.key"}[flag]
			rel, _ := filepath.Rel(m.MountPath, file)
			if !slices.ContainsFunc(v.Secret.Items, func(i corev1.KeyToPath) bool { return i.Key == key && i.Path == rel }) {
				t.Errorf("%s: Secret items %+v do not map key %s to %s", file, v.Secret.Items, key, rel)
			}
		}
	})
}

// TestIdentitySPIREValues checks identity.provider spire: the agent runs
// with --external-identities and no CA (it parses with the agent's own
// parser), the proxy gets -spire-admin-socket with the set's path, and that
// path is the same host path inside the proxy (a read-only hostPath mount
// of its directory); no CA Secret is rendered or mounted.
func TestIdentitySPIREValues(t *testing.T) {
	r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == "identity-spire" })])
	cfg := agentConfig(t, r)
	if !cfg.ExternalIdentities || cfg.CA != nil || cfg.CACertFile != "" || !cfg.HBONE() || cfg.TrustDomain != "mesh.example.com" {
		t.Errorf("agent config %+v: want --external-identities, no CA, HBONE on, trust domain mesh.example.com", cfg)
	}
	const socket = "/run/spire/agent-admin/admin.sock"
	proxy := container(t, r, "aether-proxy")
	if !slices.Contains(proxy.Args, "-spire-admin-socket="+socket) {
		t.Errorf("aether-proxy args %q lack -spire-admin-socket=%s", proxy.Args, socket)
	}
	m, v := mountOf(t, r, proxy, socket)
	if v.HostPath == nil || !m.ReadOnly {
		t.Fatalf("the proxy reaches %s through volume %+v (mount %+v): want a read-only host path", socket, v, m)
	}
	if rel, err := filepath.Rel(m.MountPath, socket); err != nil || filepath.Join(v.HostPath.Path, rel) != socket {
		t.Errorf("the proxy sees host path %s at %s, want the same path", filepath.Join(v.HostPath.Path, rel), socket)
	}
	if v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectoryOrCreate {
		t.Errorf("spire admin volume type %v, want DirectoryOrCreate (the proxy starts before SPIRE serves)", v.HostPath.Type)
	}
	for _, o := range r.objs {
		if s, ok := o.(*corev1.Secret); ok {
			t.Errorf("provider spire renders Secret %s: no CA belongs on the nodes", s.Name)
		}
	}
	for _, vol := range r.ds.Spec.Template.Spec.Volumes {
		if vol.Secret != nil {
			t.Errorf("provider spire mounts Secret volume %s", vol.Name)
		}
	}
}

// TestIdentityGeneratedCA renders identity.generateCA: a kubernetes.io/tls
// Secret whose CA the agent accepts (identity.ParseCA), mounted by the
// DaemonSet. helm template cannot look up the installed Secret, so every
// render generates a new CA (docs/identity.md says so).
func TestIdentityGeneratedCA(t *testing.T) {
	f := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(f, []byte("identity:\n  enabled: true\n  generateCA: true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	raw, err := chart.Render(t.Context(), f)
	if err != nil {
		t.Fatal(err)
	}
	var secret *corev1.Secret
	var ds *appsv1.DaemonSet
	for _, o := range decodeManifests(t, raw) {
		switch x := o.(type) {
		case *corev1.Secret:
			secret = x
		case *appsv1.DaemonSet:
			ds = x
		}
	}
	if secret == nil || ds == nil {
		t.Fatalf("render has no Secret or no DaemonSet:\n%s", raw)
	}
	if secret.Type != corev1.SecretTypeTLS || secret.Namespace != chart.Namespace {
		t.Errorf("secret %s type %s namespace %s; want kubernetes.io/tls in %s", secret.Name, secret.Type, secret.Namespace, chart.Namespace)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	if _, err := identity.ParseCA(secret.Data["tls.crt"], secret.Data["tls.key"], td, time.Now()); err != nil {
		t.Fatalf("the generated CA is refused by the agent: %v", err)
	}
	if !slices.ContainsFunc(ds.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool {
		return v.Secret != nil && v.Secret.SecretName == secret.Name
	}) {
		t.Errorf("the DaemonSet does not mount the generated Secret %s", secret.Name)
	}
}

// TestInstallerArgsParse checks the installer sidecar: a native sidecar
// whose args parse with cniinstall's own parser, whose dirs are the mounts
// of the chart's host paths, which copies from the image's bin dir and
// gets its pod's name and namespace.
func TestInstallerArgsParse(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		c := container(t, r, "install-cni")
		if !slices.ContainsFunc(r.ds.Spec.Template.Spec.InitContainers, func(i corev1.Container) bool { return i.Name == c.Name }) ||
			c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways {
			t.Fatal("install-cni must be an init container with restartPolicy Always (a native sidecar)")
		}
		o := installerOptions(t, r)
		if o.Config.SourceDir != oci.BinDir {
			t.Errorf("--source-dir %q, want the image's bin dir %s", o.Config.SourceDir, oci.BinDir)
		}
		values := chartValues(t, r)
		for _, d := range []struct{ path, host string }{{o.Config.BinDir, values.HostPaths["cniBinDir"]}, {o.Config.ConfDir, values.HostPaths["cniConfDir"]}} {
			m, v := mountOf(t, r, c, d.path)
			if v.HostPath == nil || m.MountPath != d.path || v.HostPath.Path != d.host {
				t.Errorf("installer dir %s: want the mount of host path %s, got mount %+v of %+v", d.path, d.host, m, v.VolumeSource)
			}
		}
		want := filepath.Join(values.HostPaths["stateDir"], "cni-install", "state.json")
		m, v := mountOf(t, r, c, o.Config.StateFile)
		if v.HostPath == nil || v.HostPath.Path != m.MountPath || filepath.Clean(o.Config.StateFile) != want {
			t.Errorf("state file %s: want %s on the same host path, got mount %+v of %+v", o.Config.StateFile, want, m, v.VolumeSource)
		}
		env := envVars(c)
		if env["POD_NAME"] != "metadata.name" || env["POD_NAMESPACE"] != "metadata.namespace" {
			t.Errorf("installer env %v: want POD_NAME and POD_NAMESPACE from the downward API", env)
		}
	})
}

// TestImageCommands checks every container runs a release binary from the
// image's bin dir.
func TestImageCommands(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		for _, c := range ownContainers(r) {
			if len(c.Command) != 1 || filepath.Dir(c.Command[0]) != oci.BinDir {
				t.Errorf("container %s command %q: want one binary in %s", c.Name, c.Command, oci.BinDir)
				continue
			}
			if _, err := os.Stat(filepath.Join(harness.ModuleRoot(), "cmd", filepath.Base(c.Command[0]))); err != nil {
				t.Errorf("container %s runs %s, which no cmd/ builds", c.Name, c.Command[0])
			}
		}
	})
}

// TestGracePeriod checks a stopping pod leaves aether-proxy its whole
// SIGTERM drain (-shutdown-drain) and the install-cni sidecar, stopped after
// it, 10 s to uninstall.
func TestGracePeriod(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		drain := time.Duration(-1)
		for _, a := range container(t, r, "aether-proxy").Args {
			if v, ok := strings.CutPrefix(a, "-shutdown-drain="); ok {
				d, err := time.ParseDuration(v)
				if err != nil {
					t.Fatalf("aether-proxy %s: %v", a, err)
				}
				drain = d
			}
		}
		grace := r.ds.Spec.Template.Spec.TerminationGracePeriodSeconds
		if drain < 0 || grace == nil || time.Duration(*grace)*time.Second < drain+10*time.Second {
			t.Errorf("terminationGracePeriodSeconds %v, proxy -shutdown-drain %s: want the grace period at least 10s above the drain", grace, drain)
		}
	})
}

// TestNodeGating checks the RBAC follows node gating: with it the
// ClusterRole bound to the DaemonSet's ServiceAccount allows get and patch
// on nodes, without it only get.
func TestNodeGating(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		cfg := agentConfig(t, r)
		verbs := nodeVerbs(t, r)
		if !slices.Contains(verbs, "get") {
			t.Errorf("the agent's ClusterRole does not allow get on nodes (locality): %q", verbs)
		}
		if cfg.RemoveNotReadyTaint != slices.Contains(verbs, "patch") {
			t.Errorf("--remove-not-ready-taint=%v but nodes verbs %q: patch is needed to remove %s, and only then", cfg.RemoveNotReadyTaint, verbs, nodegate.TaintKey)
		}
	})
}

// TestCSIDriver checks the csi.aether.io wiring: the driver's args parse
// with its own parser and name the agent's UDS root, exactly one
// registration announces its socket to kubelet (its own, built in, or
// csi-node-driver-registrar's with csi.registrar sidecar), the target dir
// propagates back to the host, and
// the CSIDriver object asks for what the driver needs (inline volumes, the
// pod's uid); without csi.enabled none of it is rendered.
func TestCSIDriver(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		var drivers []*storagev1.CSIDriver
		for _, o := range r.objs {
			if d, ok := o.(*storagev1.CSIDriver); ok {
				drivers = append(drivers, d)
			}
		}
		c, ok := findContainer(r, "aether-csi")
		if !ok {
			if len(drivers) > 0 {
				t.Fatalf("CSIDriver rendered without the aether-csi container")
			}
			return
		}
		if len(drivers) != 1 || drivers[0].Name != meshcontract.CSIDriver {
			t.Fatalf("want one CSIDriver %s, got %d", meshcontract.CSIDriver, len(drivers))
		}
		spec := drivers[0].Spec
		if spec.PodInfoOnMount == nil || !*spec.PodInfoOnMount || spec.AttachRequired == nil || *spec.AttachRequired ||
			!slices.Equal(spec.VolumeLifecycleModes, []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecycleEphemeral}) {
			t.Errorf("CSIDriver spec %+v: want podInfoOnMount, no attach, Ephemeral only", spec)
		}
		var stderr bytes.Buffer
		cfg, err := csi.ParseFlags(expand(c.Args), &stderr)
		if err != nil {
			t.Fatalf("aether-csi rejects the chart's args: %v\n%s", err, stderr.String())
		}
		if agent := agentConfig(t, r); cfg.Root != agent.UDSRoot {
			t.Errorf("aether-csi --uds-csi-root=%s, aether-agent --uds-csi-root=%s: they must agree", cfg.Root, agent.UDSRoot)
		}
		want := filepath.Join(cfg.KubeletDir, "plugins", meshcontract.CSIDriver, filepath.Base(cfg.Endpoint))
		reg, sidecar := findContainer(r, "csi-node-driver-registrar")
		switch {
		case sidecar && cfg.RegistrationDir != "":
			t.Errorf("aether-csi registers itself in %s and csi-node-driver-registrar runs too: two registrations", cfg.RegistrationDir)
		case sidecar:
			if !slices.Contains(reg.Args, "--kubelet-registration-path="+want) {
				t.Errorf("registrar args %q do not register %s (the driver's --endpoint %s)", reg.Args, want, cfg.Endpoint)
			}
		case cfg.RegistrationDir == "":
			t.Fatal("aether-csi neither registers itself nor has csi-node-driver-registrar: kubelet never learns the driver")
		default:
			// Built in: kubelet's plugin watcher reads plugins_registry and
			// dials the announced endpoint on the host, so both sockets must
			// sit under the kubelet dir, mounted at the host's path.
			if cfg.RegistrationDir != filepath.Join(cfg.KubeletDir, "plugins_registry") || cfg.KubeletEndpoint != want || cfg.Endpoint != want {
				t.Errorf("aether-csi registers in %q announcing %q (listening on %q); want %s/plugins_registry announcing %s",
					cfg.RegistrationDir, cfg.KubeletEndpoint, cfg.Endpoint, cfg.KubeletDir, want)
			}
		}
		propagates := slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
			return m.MountPath == cfg.KubeletDir && m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional
		})
		if !propagates || c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
			t.Errorf("aether-csi needs %s mounted Bidirectional and privileged, got mounts %+v", cfg.KubeletDir, c.VolumeMounts)
		}
	})
}

// TestInstallerStartupProbe checks the sidecar's startup probe asks the
// installer's own --check-ready about the ready file the installer writes,
// so the agent starts only once aether-cni is chained.
func TestInstallerStartupProbe(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		c := container(t, r, "install-cni")
		if c.StartupProbe == nil || c.StartupProbe.Exec == nil || len(c.StartupProbe.Exec.Command) < 2 {
			t.Fatalf("install-cni has no exec startup probe: %+v", c.StartupProbe)
		}
		cmd := c.StartupProbe.Exec.Command
		if cmd[0] != c.Command[0] {
			t.Errorf("startup probe runs %s, want the installer %s", cmd[0], c.Command[0])
		}
		var stderr bytes.Buffer
		probe, err := cniinstall.ParseFlags(cmd[1:], &stderr)
		if err != nil {
			t.Fatalf("aether-cni-install rejects the probe's args %q: %v\n%s", cmd[1:], err, stderr.String())
		}
		want := installerOptions(t, r).Config.ReadyFile
		if !probe.CheckReady || want == "" || probe.Config.ReadyFile != want {
			t.Errorf("probe checks %q (check-ready %v), the installer writes %q", probe.Config.ReadyFile, probe.CheckReady, want)
		}
	})
}

// TestInstallerRBAC checks the installer can answer its rolling-update
// question: with --uninstall-on-exit=auto a Role in the release namespace,
// bound to the DaemonSet's ServiceAccount, allows get on pods and get on
// the chart's DaemonSet (by name); with another mode no Role is rendered.
func TestInstallerRBAC(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		mode := installerOptions(t, r).Config.UninstallOnExit
		sa := r.ds.Spec.Template.Spec.ServiceAccountName
		roles := map[string]*rbacv1.Role{}
		for _, o := range r.objs {
			if role, ok := o.(*rbacv1.Role); ok {
				roles[role.Name] = role
			}
		}
		var rules []rbacv1.PolicyRule
		for _, o := range r.objs {
			b, ok := o.(*rbacv1.RoleBinding)
			if !ok || b.Namespace != chart.Namespace || b.RoleRef.Kind != "Role" || !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
				return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == chart.Namespace
			}) {
				continue
			}
			role := roles[b.RoleRef.Name]
			if role == nil || role.Namespace != chart.Namespace {
				t.Fatalf("RoleBinding %s names Role %s, which the chart does not render in %s", b.Name, b.RoleRef.Name, chart.Namespace)
			}
			rules = append(rules, role.Rules...)
		}
		allows := func(group, resource, name string) bool {
			return slices.ContainsFunc(rules, func(rule rbacv1.PolicyRule) bool {
				return slices.Contains(rule.APIGroups, group) && slices.Contains(rule.Resources, resource) &&
					slices.Contains(rule.Verbs, "get") && (len(rule.ResourceNames) == 0 || slices.Contains(rule.ResourceNames, name))
			})
		}
		if mode != cniinstall.UninstallAuto {
			if len(rules) > 0 {
				t.Errorf("--uninstall-on-exit=%s asks the API nothing, but the chart binds a Role: %+v", mode, rules)
			}
			return
		}
		if !allows("", "pods", "any-pod") {
			t.Errorf("--uninstall-on-exit=auto: no Role lets the installer get its own pod (rules %+v)", rules)
		}
		if !allows("apps", "daemonsets", r.ds.Name) {
			t.Errorf("--uninstall-on-exit=auto: no Role lets the installer get DaemonSet %s (rules %+v)", r.ds.Name, rules)
		}
		if allows("apps", "daemonsets", "another-daemonset") {
			t.Errorf("the installer's Role allows get on every DaemonSet; it needs only %s", r.ds.Name)
		}
	})
}

// nodeVerbs returns the verbs on nodes of the ClusterRoles bound to the
// DaemonSet's ServiceAccount.
func nodeVerbs(t *testing.T, r *render) []string {
	t.Helper()
	sa := r.ds.Spec.Template.Spec.ServiceAccountName
	roles := map[string]*rbacv1.ClusterRole{}
	for _, o := range r.objs {
		if cr, ok := o.(*rbacv1.ClusterRole); ok {
			roles[cr.Name] = cr
		}
	}
	var verbs []string
	bound := false
	for _, o := range r.objs {
		b, ok := o.(*rbacv1.ClusterRoleBinding)
		if !ok || !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == chart.Namespace
		}) {
			continue
		}
		role := roles[b.RoleRef.Name]
		if role == nil {
			t.Fatalf("ClusterRoleBinding %s names ClusterRole %s, which the chart does not render", b.Name, b.RoleRef.Name)
		}
		bound = true
		for _, rule := range role.Rules {
			if slices.Contains(rule.APIGroups, "") && slices.Contains(rule.Resources, "nodes") {
				verbs = append(verbs, rule.Verbs...)
			}
		}
	}
	if !bound {
		t.Fatalf("no ClusterRoleBinding binds ServiceAccount %s/%s", chart.Namespace, sa)
	}
	return verbs
}

// TestSocketLayout checks every side names the same sockets, and that they
// sit in directories of their own below the hostPath: the agent's own (CNI,
// admin) in agent/, the ones the proxy dials (xDS, LDS) in proxy/, so the
// proxy can mount proxy/ without the others; kubelet creates the hostPath
// 0755, which the agent refuses as a socket directory.
func TestSocketLayout(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		cfg := agentConfig(t, r)
		var hostPath string
		for _, v := range r.ds.Spec.Template.Spec.Volumes {
			if v.Name == "run-aether" && v.HostPath != nil {
				hostPath = v.HostPath.Path
			}
		}
		if hostPath == "" {
			t.Fatal("no run-aether hostPath volume")
		}
		runDir := chartValues(t, r).HostPaths["runDir"]
		socketDir, proxyDir := filepath.Join(runDir, "agent"), filepath.Join(runDir, "proxy")
		if hostPath != runDir {
			t.Errorf("run-aether is host path %s, want hostPaths.runDir %s", hostPath, runDir)
		}
		for s, want := range map[string]string{cfg.CNISocket: socketDir, cfg.AdminSocket: socketDir, cfg.XDSSocket: proxyDir, cfg.LDSSocket: proxyDir} {
			if dir := filepath.Dir(s); dir != want || dir == hostPath {
				t.Errorf("agent socket %q: want it in %s, a directory of its own below the hostPath %s", s, want, hostPath)
			}
		}
		proxyArgs := expand(container(t, r, "aether-proxy").Args)
		for _, want := range []string{"-xds-address=unix://" + cfg.XDSSocket, "-lds-address=unix://" + cfg.LDSSocket} {
			if !slices.Contains(proxyArgs, want) {
				t.Errorf("aether-proxy args %q lack %q", proxyArgs, want)
			}
		}
		// The installer writes the host paths into the chained entry that
		// aether-cni reads on the host.
		var entry struct {
			AgentSocket string `json:"agent_socket"`
			PinDir      string `json:"netns_pin_dir"`
		}
		if err := json.Unmarshal(installerOptions(t, r).Config.Entry, &entry); err != nil {
			t.Fatal(err)
		}
		if entry.AgentSocket != cfg.CNISocket {
			t.Errorf("installer --agent-socket %q, agent --cni-socket %q: want one path", entry.AgentSocket, cfg.CNISocket)
		}
		if entry.PinDir != filepath.Join(runDir, "netns") {
			t.Errorf("installer --netns-pin-dir %q: want netns below the hostPath %s", entry.PinDir, hostPath)
		}
		// With the default host paths the chart's paths are the
		// binaries' defaults (aether-cni's for a hand-written entry,
		// aetherctl's for the admin and xds sockets).
		if runDir == readValues(t).HostPaths["runDir"] &&
			(socketDir != app.SocketDir || entry.AgentSocket != meshcni.DefaultAgentSocket || entry.PinDir != meshcni.DefaultPinDir) {
			t.Errorf("default runDir: socket dir %s, agent_socket %q, netns_pin_dir %q; want the binaries' defaults %s, %s, %s",
				socketDir, entry.AgentSocket, entry.PinDir, app.SocketDir, meshcni.DefaultAgentSocket, meshcni.DefaultPinDir)
		}
	})
	// aetherctl's defaults (it runs on the node, in the agent's container)
	// name the agent's default sockets.
	def, err := app.ParseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if adminapi.DefaultSocket != def.AdminSocket || workloadclient.DefaultSocket != def.XDSSocket {
		t.Errorf("aetherctl defaults admin %q, xds %q; the agent's are %q, %q", adminapi.DefaultSocket, workloadclient.DefaultSocket, def.AdminSocket, def.XDSSocket)
	}
	// The static conflist for hand installs names the same socket.
	raw, err := os.ReadFile(filepath.Join("cni", "10-aether.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.NetworkConfFromBytes(raw)
	if err != nil {
		t.Fatal(err)
	}
	var entry struct {
		AgentSocket string `json:"agent_socket"`
	}
	if err := json.Unmarshal(list.Plugins[len(list.Plugins)-1].Bytes, &entry); err != nil {
		t.Fatal(err)
	}
	if entry.AgentSocket != def.CNISocket || entry.AgentSocket != meshcni.DefaultAgentSocket {
		t.Errorf("conflist agent_socket %q, agent default --cni-socket %q, aether-cni default %q: want one path", entry.AgentSocket, def.CNISocket, meshcni.DefaultAgentSocket)
	}
}

var (
	proxyFlagsOnce sync.Once
	proxyFlags     map[string]bool
	proxyHelp      []byte
)

func TestProxyArgsExist(t *testing.T) {
	proxyFlagsOnce.Do(func() {
		bin := filepath.Join(harness.BuildOwn(t, "aether-proxy"), "aether-proxy")
		proxyHelp, _ = exec.Command(bin, "-h").CombinedOutput()
		proxyFlags = map[string]bool{}
		for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z-]+)`).FindAllStringSubmatch(string(proxyHelp), -1) {
			proxyFlags[m[1]] = true
		}
	})
	if len(proxyFlags) == 0 {
		t.Fatalf("could not read aether-proxy's flags from -h:\n%s", proxyHelp)
	}
	forEachSet(t, func(t *testing.T, r *render) {
		for _, a := range expand(container(t, r, "aether-proxy").Args) {
			name := strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-")
			if !proxyFlags[name] {
				t.Errorf("aether-proxy has no flag %q (chart arg %q)", name, a)
			}
		}
	})
}

func TestConflistParses(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("cni", "10-aether.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.NetworkConfFromBytes(raw)
	if err != nil {
		t.Fatalf("libcni rejects the conflist: %v", err)
	}
	if len(list.Plugins) != 2 || list.Plugins[0].Network.Type != "eni-vlan" || list.Plugins[1].Network.Type != "aether-cni" {
		t.Fatalf("want eni-vlan then aether-cni, got %d plugins", len(list.Plugins))
	}
	// Each plugin gets its object with the list's name and version, as
	// libcni passes it.
	inject := func(b []byte) []byte {
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		m["cniVersion"], m["name"] = list.CNIVersion, list.Name
		out, _ := json.Marshal(m)
		return out
	}
	if _, err := config.Parse(inject(list.Plugins[0].Bytes)); err != nil {
		t.Errorf("eni-vlan rejects its netconf: %v", err)
	}
	mc, err := meshcni.ParseConfig(inject(list.Plugins[1].Bytes), false)
	if err != nil {
		t.Fatalf("aether-cni rejects its netconf: %v", err)
	}
	if !mc.Capture.RedirectAll {
		t.Error("the node conflist must divert every port (redirect_all), or pod traffic is not captured")
	}
}

// allContainers returns the DaemonSet's init containers and containers.
func allContainers(r *render) []corev1.Container {
	spec := r.ds.Spec.Template.Spec
	return append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
}

// ownContainers are the containers that run the aether-node image: all but
// the upstream node-driver-registrar.
func ownContainers(r *render) []corev1.Container {
	return slices.DeleteFunc(allContainers(r), func(c corev1.Container) bool { return c.Name == "csi-node-driver-registrar" })
}

// envVars maps each env var of c taken from the downward API to its field.
func envVars(c corev1.Container) map[string]string {
	out := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			out[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	return out
}

// mountOf returns c's mount holding path and the volume behind it.
func mountOf(t *testing.T, r *render, c corev1.Container, path string) (corev1.VolumeMount, corev1.Volume) {
	t.Helper()
	var best corev1.VolumeMount
	for _, m := range c.VolumeMounts {
		if rel, err := filepath.Rel(m.MountPath, path); err == nil && !strings.HasPrefix(rel, "..") && len(m.MountPath) > len(best.MountPath) {
			best = m
		}
	}
	if best.Name == "" {
		t.Fatalf("container %s mounts nothing holding %s", c.Name, path)
	}
	for _, v := range r.ds.Spec.Template.Spec.Volumes {
		if v.Name == best.Name {
			return best, v
		}
	}
	t.Fatalf("container %s mounts volume %s, which the pod does not define", c.Name, best.Name)
	return best, corev1.Volume{}
}

// renderedValues are the values the tests compare the render with.
type renderedValues struct {
	// HostPaths is hostPaths: runDir, stateDir, cniBinDir, cniConfDir,
	// kubeletDir.
	HostPaths map[string]string `yaml:"hostPaths"`
}

// chartValues reads the host paths a render used: its values files over
// the chart's defaults.
func chartValues(t *testing.T, r *render) renderedValues {
	t.Helper()
	return readValues(t, r.set.paths()...)
}

// readValues reads the host paths of the chart's defaults overlaid by
// files.
func readValues(t *testing.T, files ...string) renderedValues {
	t.Helper()
	v := renderedValues{HostPaths: map[string]string{}}
	for _, f := range append([]string{filepath.Join(chart.Dir(), "values.yaml")}, files...) {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var one renderedValues
		if err := yaml.Unmarshal(raw, &one); err != nil {
			t.Fatalf("failed to read values %s: %v", f, err)
		}
		maps.Copy(v.HostPaths, one.HostPaths)
	}
	return v
}

// TestProxySeesUDSSockets checks aether-proxy can connect to the UDS
// sockets the agent resolves (<uds-csi-root>/<uid>/<file>, host paths it
// hands the proxy in the listener metadata): the proxy mounts the host's
// --uds-csi-root at the same path.
func TestProxySeesUDSSockets(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		root := agentConfig(t, r).UDSRoot
		m, v := mountOf(t, r, container(t, r, "aether-proxy"), filepath.Join(root, "some-uid", "app.sock"))
		if v.HostPath == nil {
			t.Fatalf("the proxy reaches %s through volume %s, which is not a host path", root, v.Name)
		}
		rel, err := filepath.Rel(m.MountPath, root)
		if err != nil || filepath.Join(v.HostPath.Path, rel) != root {
			t.Errorf("the proxy sees host path %s at %s: want the agent's --uds-csi-root %s at the same path", filepath.Join(v.HostPath.Path, rel), root, root)
		}
	})
}
