// Package manifests is the pod source for standalone nodes and demos: a
// directory of Pod manifests (YAML or JSON, several documents per file
// allowed), rescanned on an interval and on every lookup miss. Removing a
// manifest deletes its pods; setting metadata.deletionTimestamp marks them
// terminating. Namespace objects in the directory carry the labels the
// enrolment rules read; a namespace without one has no labels.
package manifests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"aether.io/node/agent/podsource"
)

// MaxManifestBytes bounds one manifest file.
const MaxManifestBytes = 4 << 20

// Parse decodes every Pod in a YAML or JSON stream. Services and
// EndpointSlices (read by the agent's Service model from the same
// directory, ParseObjects) are skipped; documents of any other kind are an
// error, and so are objects without a name; an empty namespace becomes
// "default".
func Parse(data []byte) ([]*corev1.Pod, error) {
	objs, err := ParseObjects(data)
	if err != nil {
		return nil, err
	}
	return objs.Pods, nil
}

// Objects are the objects of a manifest stream, by kind.
type Objects struct {
	Pods           []*corev1.Pod
	Services       []*corev1.Service
	EndpointSlices []*discoveryv1.EndpointSlice
	// Namespaces are the Namespace objects (cluster-scoped: their
	// namespace stays empty).
	Namespaces []*corev1.Namespace
	// AuthorizationPolicies are security.istio.io AuthorizationPolicy
	// objects as JSON, for the agent's policy model to decode with Istio's
	// types (agent/policy.ParseObject).
	AuthorizationPolicies [][]byte
	// PeerAuthentications are security.istio.io PeerAuthentication objects
	// as JSON (agent/policy.ParsePeerObject).
	PeerAuthentications [][]byte
}

// Kinds a manifest directory may hold, as "apiVersion kind".
const (
	kindPod           = "v1 Pod"
	kindService       = "v1 Service"
	kindEndpointSlice = "discovery.k8s.io/v1 EndpointSlice"
	kindNamespace     = "v1 Namespace"
	kindAuthzV1       = "security.istio.io/v1 AuthorizationPolicy"
	kindAuthzV1beta1  = "security.istio.io/v1beta1 AuthorizationPolicy"
	kindPeerV1        = "security.istio.io/v1 PeerAuthentication"
	kindPeerV1beta1   = "security.istio.io/v1beta1 PeerAuthentication"
)

// ParseObjects decodes every Pod, Service, EndpointSlice, Namespace and
// Istio security policy in a YAML or JSON stream (several documents
// allowed). Another kind is an error that names the allowed ones, and so is
// an object without a name; an empty namespace of a namespaced object
// becomes "default".
func ParseObjects(data []byte) (Objects, error) {
	var out Objects
	if len(data) > MaxManifestBytes {
		return out, fmt.Errorf("failed to parse manifest: %d bytes is over the %d-byte limit", len(data), MaxManifestBytes)
	}
	docs, err := documents(data)
	if err != nil {
		return out, err
	}
	for i, raw := range docs {
		if t := bytes.TrimSpace(raw); len(t) == 0 || string(t) == "null" {
			continue // empty document
		}
		var head struct {
			metav1.TypeMeta `json:",inline"`
			Metadata        struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(raw, &head); err != nil {
			return Objects{}, fmt.Errorf("failed to parse manifest document %d: %w", i, err)
		}
		if head.Kind == "" && head.APIVersion == "" && head.Metadata.Name == "" {
			continue // an empty object
		}
		apiVersion := head.APIVersion
		if apiVersion == "" && (head.Kind == "Pod" || head.Kind == "Service" || head.Kind == "Namespace") {
			apiVersion = "v1"
		}
		var obj interface {
			GetName() string
			GetNamespace() string
			SetNamespace(string)
		}
		switch apiVersion + " " + head.Kind {
		case kindAuthzV1, kindAuthzV1beta1, kindPeerV1, kindPeerV1beta1:
			j, err := yaml.YAMLToJSON(raw)
			if err != nil {
				return Objects{}, fmt.Errorf("failed to parse manifest document %d (%s): %w", i, head.Kind, err)
			}
			if head.Metadata.Name == "" {
				return Objects{}, fmt.Errorf("failed to parse manifest document %d (%s): metadata.name is required", i, head.Kind)
			}
			if head.Kind == "PeerAuthentication" {
				out.PeerAuthentications = append(out.PeerAuthentications, j)
			} else {
				out.AuthorizationPolicies = append(out.AuthorizationPolicies, j)
			}
			continue
		case kindPod:
			p := &corev1.Pod{}
			out.Pods, obj = append(out.Pods, p), p
		case kindService:
			s := &corev1.Service{}
			out.Services, obj = append(out.Services, s), s
		case kindEndpointSlice:
			es := &discoveryv1.EndpointSlice{}
			out.EndpointSlices, obj = append(out.EndpointSlices, es), es
		case kindNamespace:
			n := &corev1.Namespace{}
			if err := yaml.Unmarshal(raw, n); err != nil {
				return Objects{}, fmt.Errorf("failed to parse manifest document %d (Namespace): %w", i, err)
			}
			if n.Name == "" {
				return Objects{}, fmt.Errorf("failed to parse manifest document %d (Namespace): metadata.name is required", i)
			}
			out.Namespaces = append(out.Namespaces, n)
			continue
		default:
			return Objects{}, fmt.Errorf("failed to parse manifest document %d: kind %q apiVersion %q, only %s, %s, %s, %s, %s and %s are allowed",
				i, head.Kind, head.APIVersion, kindPod, kindService, kindEndpointSlice, kindNamespace, kindAuthzV1, kindPeerV1)
		}
		// sigs.k8s.io/yaml converts by the target's types, as kubelet's
		// decoder does (an unquoted `nodeName: n` arrives as "false").
		if err := yaml.Unmarshal(raw, obj); err != nil {
			return Objects{}, fmt.Errorf("failed to parse manifest document %d (%s): %w", i, head.Kind, err)
		}
		if obj.GetName() == "" {
			return Objects{}, fmt.Errorf("failed to parse manifest document %d (%s): metadata.name is required", i, head.Kind)
		}
		if obj.GetNamespace() == "" {
			obj.SetNamespace("default")
		}
	}
	return out, nil
}

// documents splits a manifest stream into its documents: YAML documents
// (separated by ---), or the objects of a JSON stream.
func documents(data []byte) ([][]byte, error) {
	var docs [][]byte
	if t := bytes.TrimSpace(data); len(t) > 0 && t[0] == '{' {
		dec := json.NewDecoder(bytes.NewReader(t))
		for i := 0; ; i++ {
			var raw json.RawMessage
			if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
				return docs, nil
			} else if err != nil {
				return nil, fmt.Errorf("failed to parse manifest document %d: %w", i, err)
			}
			docs = append(docs, raw)
		}
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("failed to parse manifest document %d: %w", i, err)
		}
		docs = append(docs, doc)
	}
}

// Source watches a directory of manifests.
type Source struct {
	dir      string
	node     string
	interval time.Duration
	log      *slog.Logger

	mu   sync.Mutex
	pods map[string]*podsource.Pod // ns/name
	// namespaces are the labels of the directory's Namespace objects.
	namespaces map[string]map[string]string
	files      map[string]fileStamp
	synced     chan struct{}
	h          podsource.Handler
	scanMu     sync.Mutex
	// pending are the changes scans found, in order, for Run to deliver:
	// a scan never calls the handler, so a slow handler (a registry write
	// while etcd is away) never holds up Get's rescan on a miss.
	pending []change
	kick    chan struct{} // one slot: pending has changes
}

// change is one pod change a scan found.
type change struct {
	pod     *podsource.Pod
	deleted bool
}

type fileStamp struct {
	size       int64
	mod        time.Time
	pods       []string
	namespaces []string
}

var (
	_ podsource.Source     = (*Source)(nil)
	_ podsource.Namespaces = (*Source)(nil)
)

// New returns a source for dir. Pods whose spec.nodeName names another node
// are skipped; an empty nodeName means this node. interval <= 0 means 1s.
func New(dir, node string, interval time.Duration, log *slog.Logger) *Source {
	if interval <= 0 {
		interval = time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{
		dir: dir, node: node, interval: interval, log: log, pods: map[string]*podsource.Pod{},
		namespaces: map[string]map[string]string{}, files: map[string]fileStamp{}, synced: make(chan struct{}), kick: make(chan struct{}, 1),
	}
}

// Get returns the pod, rescanning the directory once on a miss.
func (s *Source) Get(ctx context.Context, namespace, name string) (*podsource.Pod, error) {
	id := namespace + "/" + name
	s.mu.Lock()
	p, ok := s.pods[id]
	s.mu.Unlock()
	if ok {
		return p, nil
	}
	return s.Fetch(ctx, namespace, name)
}

// Fetch rescans the directory, then returns the pod.
func (s *Source) Fetch(_ context.Context, namespace, name string) (*podsource.Pod, error) {
	s.scan()
	id := namespace + "/" + name
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.pods[id]; ok {
		return p, nil
	}
	return nil, fmt.Errorf("failed to find pod %q in %s: %w", id, s.dir, podsource.ErrNotFound)
}

// NamespaceLabels returns the labels of the directory's Namespace object
// called name; a namespace without one is known and unlabelled (a
// standalone node has no API server that could still name it).
func (s *Source) NamespaceLabels(name string) (map[string]string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.namespaces[name], true
}

// List returns every known pod.
func (s *Source) List() []*podsource.Pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*podsource.Pod, 0, len(s.pods))
	for _, p := range s.pods {
		out = append(out, p)
	}
	podsource.SortPods(out)
	return out
}

// Synced is closed after the first scan.
func (s *Source) Synced() <-chan struct{} { return s.synced }

// Run scans the directory every interval until ctx ends, and delivers to h,
// in order, the changes its own scans and Get's rescans find (Synced
// closes once the first scan's are delivered).
func (s *Source) Run(ctx context.Context, h podsource.Handler) error {
	if st, err := os.Stat(s.dir); err != nil {
		return fmt.Errorf("failed to open pod manifest dir %q: %w", s.dir, err)
	} else if !st.IsDir() {
		return fmt.Errorf("failed to open pod manifest dir %q: not a directory", s.dir)
	}
	s.mu.Lock()
	s.h = h
	s.mu.Unlock()
	s.scan()
	s.deliver(h)
	close(s.synced)
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.scan()
		case <-s.kick:
		}
		s.deliver(h)
	}
}

// deliver hands the pending changes to h, in the order scans found them.
func (s *Source) deliver(h podsource.Handler) {
	s.mu.Lock()
	changes := s.pending
	s.pending = nil
	s.mu.Unlock()
	for _, c := range changes {
		if c.deleted {
			h.OnDelete(c.pod)
		} else {
			h.OnPod(c.pod)
		}
	}
}

func isManifest(name string) bool {
	if strings.HasPrefix(name, ".") {
		return false
	}
	switch strings.ToLower(filepath.Ext(name)) {
	case ".yaml", ".yml", ".json":
		return true
	}
	return false
}

// scan re-reads changed files and queues the differences for Run.
func (s *Source) scan() {
	s.scanMu.Lock()
	defer s.scanMu.Unlock()
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		s.log.Error("failed to read pod manifest dir", "dir", s.dir, "error", err.Error())
		return
	}
	var changes []change
	seen := map[string]bool{}
	s.mu.Lock()
	for _, e := range ents {
		if e.IsDir() || !isManifest(e.Name()) {
			continue
		}
		path := filepath.Join(s.dir, e.Name())
		info, err := e.Info()
		if err != nil {
			continue
		}
		seen[path] = true
		old, had := s.files[path]
		if had && old.size == info.Size() && old.mod.Equal(info.ModTime()) {
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			s.log.Error("failed to read pod manifest", "path", path, "error", err.Error())
			continue
		}
		objs, err := ParseObjects(data)
		if err != nil {
			// Keep the previous content of a file being rewritten or
			// broken; logged once per content (the stamp is taken).
			s.log.Error("failed to parse pod manifest; keeping its previous pods", "path", path, "error", err.Error())
			old.size, old.mod = info.Size(), info.ModTime()
			s.files[path] = old
			continue
		}
		stamp := fileStamp{size: info.Size(), mod: info.ModTime()}
		s.forgetNamespacesLocked(old.namespaces)
		for _, n := range objs.Namespaces {
			s.namespaces[n.Name] = n.Labels
			stamp.namespaces = append(stamp.namespaces, n.Name)
		}
		now := map[string]bool{}
		for _, kp := range objs.Pods {
			if kp.Spec.NodeName != "" && s.node != "" && kp.Spec.NodeName != s.node {
				s.logOtherNode(path, kp)
				continue
			}
			p := podsource.FromKube(kp)
			if p.NodeName == "" {
				p.NodeName = s.node
			}
			now[p.ID()] = true
			stamp.pods = append(stamp.pods, p.ID())
			s.pods[p.ID()] = p
			changes = append(changes, change{pod: p})
		}
		for _, id := range old.pods {
			if !now[id] {
				if p, ok := s.pods[id]; ok {
					delete(s.pods, id)
					changes = append(changes, change{pod: p, deleted: true})
				}
			}
		}
		s.files[path] = stamp
	}
	for path, st := range s.files {
		if seen[path] {
			continue
		}
		s.forgetNamespacesLocked(st.namespaces)
		for _, id := range st.pods {
			if p, ok := s.pods[id]; ok {
				delete(s.pods, id)
				changes = append(changes, change{pod: p, deleted: true})
			}
		}
		delete(s.files, path)
	}
	if s.h != nil && len(changes) > 0 {
		s.pending = append(s.pending, changes...)
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
	s.mu.Unlock()
}

// forgetNamespacesLocked drops the labels of namespaces a file held (a
// file read again or removed); s.mu is held.
func (s *Source) forgetNamespacesLocked(names []string) {
	for _, n := range names {
		delete(s.namespaces, n)
	}
}

// logOtherNode says why a manifest's pod is not served here. YAML 1.1 reads
// an unquoted y/n/yes/no/on/off as a boolean, so `nodeName: n` arrives as
// "false" (kubelet's own decoder does the same): that case is a warning
// with the fix, any other node name is routine.
func (s *Source) logOtherNode(path string, kp *corev1.Pod) {
	if kp.Spec.NodeName == "true" || kp.Spec.NodeName == "false" {
		s.log.Warn("pod manifest skipped: spec.nodeName decoded as a YAML boolean, quote the node name",
			"path", path, "pod", kp.Namespace+"/"+kp.Name, "node_name", kp.Spec.NodeName, "node", s.node)
		return
	}
	s.log.Debug("pod manifest skipped: pod belongs to another node",
		"path", path, "pod", kp.Namespace+"/"+kp.Name, "node_name", kp.Spec.NodeName, "node", s.node)
}
