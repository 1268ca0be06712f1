package deploy_test

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"

	"aether.io/node/cniinstall"
	"aether.io/node/deploy/chart"
)

// containerPrivileges is what each container of the DaemonSet may hold:
// the capabilities it adds after dropping ALL, whether it is privileged,
// and why it runs as root (every container here does; a container without
// a reason must set runAsNonRoot). docs/install.md, "Security", says the
// same per container.
var containerPrivileges = map[string]struct {
	add        []corev1.Capability
	privileged bool
	root       string
}{
	"install-cni": {
		add:  []corev1.Capability{"DAC_OVERRIDE"},
		root: "writes the host's root-owned CNI dirs and state dir",
	},
	"aether-agent": {
		add:  []corev1.Capability{"NET_ADMIN", "DAC_OVERRIDE"},
		root: "serves its sockets and keeps its pod store in root-owned host dirs; added capabilities reach root only",
	},
	"aether-proxy": {
		add:  []corev1.Capability{"NET_ADMIN", "SYS_ADMIN", "NET_RAW", "DAC_OVERRIDE"},
		root: "enters pod network namespaces (setns needs SYS_ADMIN); added capabilities reach root only",
	},
	"aether-csi": {
		privileged: true,
		root:       "bind-mounts into kubelet's dir with Bidirectional propagation, which needs privileged",
	},
	"csi-node-driver-registrar": {
		root: "creates its socket in kubelet's root-owned plugins_registry",
	},
}

// TestContainerSecurity checks every container of every value set for a
// restricted-style securityContext: seccomp RuntimeDefault, a read-only
// root file system, no privilege escalation, ALL capabilities dropped and
// only its own added back, privileged only where the API demands it, and
// runAsNonRoot unless the container has a reason to run as root.
func TestContainerSecurity(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		pod := r.ds.Spec.Template.Spec
		for _, c := range allContainers(r) {
			want, ok := containerPrivileges[c.Name]
			if !ok {
				t.Errorf("container %s has no entry in containerPrivileges: decide its capabilities and whether it can run as non-root", c.Name)
				continue
			}
			sc := c.SecurityContext
			if sc == nil {
				t.Errorf("container %s has no securityContext", c.Name)
				continue
			}
			seccomp := sc.SeccompProfile
			if seccomp == nil && pod.SecurityContext != nil {
				seccomp = pod.SecurityContext.SeccompProfile
			}
			if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Errorf("container %s seccomp profile %+v, want RuntimeDefault", c.Name, seccomp)
			}
			if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("container %s: want readOnlyRootFilesystem (every binary writes only its mounts)", c.Name)
			}
			privileged := sc.Privileged != nil && *sc.Privileged
			if privileged != want.privileged {
				t.Errorf("container %s privileged %v, want %v", c.Name, privileged, want.privileged)
			}
			nonRoot := sc.RunAsNonRoot != nil && *sc.RunAsNonRoot
			if !nonRoot && want.root == "" {
				t.Errorf("container %s may run as root but has no reason to: set runAsNonRoot", c.Name)
			}
			if privileged {
				// The API refuses allowPrivilegeEscalation false with
				// privileged, which holds every capability anyway.
				continue
			}
			if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("container %s: want allowPrivilegeEscalation false", c.Name)
			}
			if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
				t.Errorf("container %s capabilities %+v: want drop [ALL]", c.Name, sc.Capabilities)
				continue
			}
			if !slices.Equal(sc.Capabilities.Add, want.add) {
				t.Errorf("container %s adds capabilities %q, want exactly %q", c.Name, sc.Capabilities.Add, want.add)
			}
		}
	})
}

// TestServiceAccountToken checks the ServiceAccount token reaches only the
// containers that talk to the API: the pod does not automount it, and a
// projected token volume is mounted at the in-cluster path into
// aether-agent (pod source, Node) and, with --uninstall-on-exit=auto,
// install-cni (its pod and DaemonSet); no other container mounts it.
func TestServiceAccountToken(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		pod := r.ds.Spec.Template.Spec
		if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
			t.Errorf("automountServiceAccountToken %v: want false, or every container gets the token", pod.AutomountServiceAccountToken)
		}
		tokenVolumes := map[string]bool{}
		for _, v := range pod.Volumes {
			if v.Projected == nil {
				continue
			}
			if slices.ContainsFunc(v.Projected.Sources, func(s corev1.VolumeProjection) bool { return s.ServiceAccountToken != nil }) {
				tokenVolumes[v.Name] = true
				paths := map[string]bool{}
				for _, s := range v.Projected.Sources {
					switch {
					case s.ServiceAccountToken != nil:
						paths[s.ServiceAccountToken.Path] = s.ServiceAccountToken.Audience == ""
					case s.ConfigMap != nil && s.ConfigMap.Name == "kube-root-ca.crt":
						for _, i := range s.ConfigMap.Items {
							paths[i.Path] = i.Key == "ca.crt"
						}
					}
				}
				if !paths["token"] || !paths["ca.crt"] {
					t.Errorf("token volume %s holds %v: want token (for the API server's audience) and ca.crt, as client-go's in-cluster config reads them", v.Name, paths)
				}
			}
		}
		wantAPI := map[string]bool{"aether-agent": true, "install-cni": installerOptions(t, r).Config.UninstallOnExit == cniinstall.UninstallAuto}
		for _, c := range allContainers(r) {
			var mounted []corev1.VolumeMount
			for _, m := range c.VolumeMounts {
				if tokenVolumes[m.Name] {
					mounted = append(mounted, m)
				}
			}
			if !wantAPI[c.Name] {
				if len(mounted) > 0 {
					t.Errorf("container %s does not talk to the API but mounts the token (%+v)", c.Name, mounted)
				}
				continue
			}
			if len(mounted) != 1 || mounted[0].MountPath != cniinstall.ServiceAccountDir || !mounted[0].ReadOnly {
				t.Errorf("container %s talks to the API: want the token volume read-only at %s, got %+v", c.Name, cniinstall.ServiceAccountDir, mounted)
			}
		}
	})
}

// TestRunDirMounts checks no container but aether-agent mounts the whole
// run dir, a directory holding it, or the agent's own socket directory
// (CNI and admin sockets), and that aether-proxy mounts exactly the parts
// it uses: read-only proxy/ (its sockets and token), netns/ (pins, with
// HostToContainer) and uds/, and read-write only proxy-flows/ (its own
// flows socket), which no other container mounts.
func TestRunDirMounts(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		run := chartValues(t, r).HostPaths["runDir"]
		agentDir := filepath.Join(run, "agent")
		hostPaths := map[string]string{}
		for _, v := range r.ds.Spec.Template.Spec.Volumes {
			if v.HostPath != nil {
				hostPaths[v.Name] = v.HostPath.Path
			}
		}
		within := func(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }
		flowsDir := filepath.Join(run, "proxy-flows")
		for _, c := range allContainers(r) {
			if c.Name == "aether-agent" {
				continue
			}
			for _, m := range c.VolumeMounts {
				p, ok := hostPaths[m.Name]
				if !ok {
					continue
				}
				if within(run, p) || within(p, agentDir) {
					t.Errorf("container %s mounts host path %s (volume %s): only aether-agent may reach %s or %s", c.Name, p, m.Name, run, agentDir)
				}
				if within(p, flowsDir) && c.Name != "aether-proxy" {
					t.Errorf("container %s mounts host path %s (volume %s): only aether-proxy may reach its flows socket", c.Name, p, m.Name)
				}
			}
		}
		proxy := container(t, r, "aether-proxy")
		got := map[string]corev1.VolumeMount{}
		for _, m := range proxy.VolumeMounts {
			p, ok := hostPaths[m.Name]
			if !ok {
				continue
			}
			if !m.ReadOnly && p != flowsDir {
				t.Errorf("aether-proxy mounts host path %s read-write: it writes only %s", p, flowsDir)
			}
			if within(p, run) {
				got[p] = m
			}
		}
		want := []string{filepath.Join(run, "netns"), filepath.Join(run, "proxy"), flowsDir, filepath.Join(run, "uds")}
		if keys := slices.Sorted(maps.Keys(got)); !slices.Equal(keys, want) {
			t.Errorf("aether-proxy mounts %q of the run dir, want exactly %q", keys, want)
		}
		if m := got[filepath.Join(run, "netns")]; m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer {
			t.Errorf("aether-proxy mounts the pins without HostToContainer propagation: %+v", m)
		}
	})
}

// policies returns the ValidatingAdmissionPolicies and their bindings of
// a render.
func policies(objs []any) ([]*admissionv1.ValidatingAdmissionPolicy, []*admissionv1.ValidatingAdmissionPolicyBinding) {
	var ps []*admissionv1.ValidatingAdmissionPolicy
	var bs []*admissionv1.ValidatingAdmissionPolicyBinding
	for _, o := range objs {
		switch x := o.(type) {
		case *admissionv1.ValidatingAdmissionPolicy:
			ps = append(ps, x)
		case *admissionv1.ValidatingAdmissionPolicyBinding:
			bs = append(bs, x)
		}
	}
	return ps, bs
}

// TestNodePatchPolicy checks the rendered policy that confines the agent's
// node patch (TestNodePatchOwnNodeOnly runs it on a kube-apiserver): with
// node gating and nodeGating.ownNodeOnly one policy on updates of nodes,
// for the chart's ServiceAccount only, bound with Deny; without either,
// none.
func TestNodePatchPolicy(t *testing.T) {
	check := func(t *testing.T, objs []any, saName string, gating bool) {
		t.Helper()
		ps, bs := policies(objs)
		if !gating {
			if len(ps)+len(bs) > 0 {
				t.Errorf("no node patch to confine, but the render has %d policies and %d bindings", len(ps), len(bs))
			}
			return
		}
		if len(ps) != 1 || len(bs) != 1 {
			t.Fatalf("want one ValidatingAdmissionPolicy and one binding, got %d and %d", len(ps), len(bs))
		}
		p, b := ps[0], bs[0]
		if b.Spec.PolicyName != p.Name || !slices.Equal(b.Spec.ValidationActions, []admissionv1.ValidationAction{admissionv1.Deny}) {
			t.Errorf("binding %+v: want policy %s with Deny", b.Spec, p.Name)
		}
		if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionv1.Fail {
			t.Errorf("policy failurePolicy %v, want Fail", p.Spec.FailurePolicy)
		}
		rules := p.Spec.MatchConstraints.ResourceRules
		if len(rules) != 1 || !slices.Equal(rules[0].Resources, []string{"nodes"}) || !slices.Equal(rules[0].Operations, []admissionv1.OperationType{admissionv1.Update}) {
			t.Errorf("policy rules %+v: want UPDATE of nodes (a patch is an update)", rules)
		}
		user := "system:serviceaccount:" + chart.Namespace + ":" + saName
		if !slices.ContainsFunc(p.Spec.MatchConditions, func(c admissionv1.MatchCondition) bool { return strings.Contains(c.Expression, `"`+user+`"`) }) {
			t.Errorf("policy match conditions %+v do not name the chart's ServiceAccount %s", p.Spec.MatchConditions, user)
		}
	}
	forEachSet(t, func(t *testing.T, r *render) {
		objs := make([]any, len(r.objs))
		for i, o := range r.objs {
			objs[i] = o
		}
		check(t, objs, r.ds.Spec.Template.Spec.ServiceAccountName, agentConfig(t, r).RemoveNotReadyTaint)
	})
	t.Run("ownNodeOnly off", func(t *testing.T) {
		f := filepath.Join(t.TempDir(), "values.yaml")
		if err := os.WriteFile(f, []byte("nodeGating:\n  ownNodeOnly: false\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		raw, err := chart.Render(t.Context(), f)
		if err != nil {
			t.Fatal(err)
		}
		var objs []any
		for _, o := range decodeManifests(t, raw) {
			objs = append(objs, o)
		}
		check(t, objs, "", false)
	})
}
