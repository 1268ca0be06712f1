package services

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"

	"aether.io/node/agent/podsource/manifests"
)

// Dir feeds a Model from a directory of manifests, the one the agent's
// pod-manifests source reads (standalone nodes, the demo): its Services
// and EndpointSlices. A Service with a selector and no EndpointSlice in
// the directory gets the slices the EndpointSlice controller would write,
// from the directory's pods (so a demo needs no hand-written slice): every
// pod of its namespace matching the selector, ready unless its Ready
// condition is False or it is terminating, a named target port resolved
// from the pod's container ports.
type Dir struct {
	dir      string
	interval time.Duration
	model    *Model
	log      *slog.Logger
	files    map[string]dirFile
	synced   chan struct{}
}

type dirFile struct {
	size int64
	mod  time.Time
	objs manifests.Objects
}

// NewDir returns the directory source of m; interval <= 0 means 1 s.
func NewDir(dir string, interval time.Duration, m *Model, log *slog.Logger) *Dir {
	if interval <= 0 {
		interval = time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Dir{dir: dir, interval: interval, model: m, log: log, files: map[string]dirFile{}, synced: make(chan struct{})}
}

// Synced is closed after the first scan.
func (d *Dir) Synced() <-chan struct{} { return d.synced }

// Run scans the directory every interval until ctx ends.
func (d *Dir) Run(ctx context.Context) error {
	if st, err := os.Stat(d.dir); err != nil {
		return fmt.Errorf("failed to open manifest dir %q: %w", d.dir, err)
	} else if !st.IsDir() {
		return fmt.Errorf("failed to open manifest dir %q: not a directory", d.dir)
	}
	d.Scan()
	close(d.synced)
	t := time.NewTicker(d.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			d.Scan()
		}
	}
}

// Scan re-reads changed files and hands the model the directory's
// Services and EndpointSlices (a file that does not parse keeps its
// previous content and is logged).
func (d *Dir) Scan() {
	ents, err := os.ReadDir(d.dir)
	if err != nil {
		d.log.Error("failed to read manifest dir", "dir", d.dir, "error", err.Error())
		return
	}
	changed := false
	seen := map[string]bool{}
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() || strings.HasPrefix(name, ".") || !slices.Contains([]string{".yaml", ".yml", ".json"}, strings.ToLower(filepath.Ext(name))) {
			continue
		}
		path := filepath.Join(d.dir, name)
		info, err := e.Info()
		if err != nil {
			continue
		}
		seen[path] = true
		if old, ok := d.files[path]; ok && old.size == info.Size() && old.mod.Equal(info.ModTime()) {
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			d.log.Error("failed to read manifest", "path", path, "error", err.Error())
			continue
		}
		objs, err := manifests.ParseObjects(data)
		if err != nil {
			// Logged once per content: the file keeps its previous
			// objects until it parses again.
			d.log.Error("failed to parse manifest; keeping its previous content", "path", path, "error", err.Error())
			d.files[path] = dirFile{size: info.Size(), mod: info.ModTime(), objs: d.files[path].objs}
			continue
		}
		d.files[path] = dirFile{size: info.Size(), mod: info.ModTime(), objs: objs}
		changed = true
	}
	for path := range d.files {
		if !seen[path] {
			delete(d.files, path)
			changed = true
		}
	}
	if !changed {
		return
	}
	var all manifests.Objects
	for _, path := range slices.Sorted(maps.Keys(d.files)) {
		o := d.files[path].objs
		all.Pods = append(all.Pods, o.Pods...)
		all.Services = append(all.Services, o.Services...)
		all.EndpointSlices = append(all.EndpointSlices, o.EndpointSlices...)
	}
	d.model.Replace(all.Services, append(all.EndpointSlices, ControllerSlices(all)...))
}

// ControllerSlices returns the EndpointSlices the EndpointSlice controller
// would write for the objects' Services that have a selector and no slice
// among the objects: one per distinct set of resolved target ports, named
// <service>-manifest-<n>.
func ControllerSlices(o manifests.Objects) []*discoveryv1.EndpointSlice {
	has := map[string]bool{}
	for _, es := range o.EndpointSlices {
		has[key(es.Namespace, es.Labels[LabelServiceName])] = true
	}
	var out []*discoveryv1.EndpointSlice
	for _, svc := range o.Services {
		if len(svc.Spec.Selector) == 0 || has[key(svc.Namespace, svc.Name)] || svc.Spec.Type == corev1.ServiceTypeExternalName {
			continue
		}
		sel := labels.SelectorFromSet(svc.Spec.Selector)
		byPorts := map[string]*discoveryv1.EndpointSlice{}
		var order []string
		for _, p := range o.Pods {
			if p.Namespace != svc.Namespace || !sel.Matches(labels.Set(p.Labels)) {
				continue
			}
			ports := resolvePorts(svc, p)
			sig := fmt.Sprint(portSig(ports))
			es := byPorts[sig]
			if es == nil {
				es = &discoveryv1.EndpointSlice{
					ObjectMeta:  metav1.ObjectMeta{Namespace: svc.Namespace, Name: fmt.Sprintf("%s-manifest-%d", svc.Name, len(order)), Labels: map[string]string{LabelServiceName: svc.Name}},
					AddressType: discoveryv1.AddressTypeIPv4,
					Ports:       ports,
				}
				byPorts[sig] = es
				order = append(order, sig)
			}
			es.Endpoints = append(es.Endpoints, podEndpoint(p))
		}
		for _, sig := range order {
			out = append(out, byPorts[sig])
		}
	}
	return out
}

func portSig(ps []discoveryv1.EndpointPort) []string {
	var out []string
	for _, p := range ps {
		out = append(out, fmt.Sprintf("%s=%d", ptr.Deref(p.Name, ""), ptr.Deref(p.Port, 0)))
	}
	return out
}

// resolvePorts resolves the Service's TCP target ports for pod p: a number
// as is (unset: the service port), a name by the pod's container ports (a
// name the pod does not declare: the port is left out, as the controller
// does).
func resolvePorts(svc *corev1.Service, p *corev1.Pod) []discoveryv1.EndpointPort {
	var out []discoveryv1.EndpointPort
	for _, sp := range svc.Spec.Ports {
		if sp.Protocol != "" && sp.Protocol != corev1.ProtocolTCP {
			continue
		}
		port := sp.Port
		switch {
		case sp.TargetPort.StrVal != "":
			port = 0
			for _, c := range p.Spec.Containers {
				for _, cp := range c.Ports {
					if cp.Name == sp.TargetPort.StrVal && (cp.Protocol == "" || cp.Protocol == corev1.ProtocolTCP) {
						port = cp.ContainerPort
					}
				}
			}
		case sp.TargetPort.IntVal != 0:
			port = sp.TargetPort.IntVal
		}
		if port == 0 {
			continue
		}
		out = append(out, discoveryv1.EndpointPort{Name: ptr.To(sp.Name), Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolTCP)})
	}
	return out
}

// podEndpoint is p as an EndpointSlice endpoint.
func podEndpoint(p *corev1.Pod) discoveryv1.Endpoint {
	ready := p.DeletionTimestamp == nil
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionFalse {
			ready = false
		}
	}
	e := discoveryv1.Endpoint{
		Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready), Serving: ptr.To(ready || p.DeletionTimestamp != nil), Terminating: ptr.To(p.DeletionTimestamp != nil)},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: p.Namespace, Name: p.Name, UID: p.UID},
	}
	if p.Spec.NodeName != "" {
		e.NodeName = ptr.To(p.Spec.NodeName)
	}
	for _, ip := range p.Status.PodIPs {
		e.Addresses = append(e.Addresses, ip.IP)
	}
	if len(e.Addresses) == 0 && p.Status.PodIP != "" {
		e.Addresses = []string{p.Status.PodIP}
	}
	return e
}
