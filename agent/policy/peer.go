package policy

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	securityv1beta1 "istio.io/api/security/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"aether.io/node/api/istio/security"
)

// PeerAuthentication kinds as the model reads them.
const (
	KindPeerAuthentication     = "PeerAuthentication"
	ResourcePeerAuthentication = "peerauthentications"
	// StaticStrictName is the policy (in the root namespace) bound to every
	// workload whose effective mTLS mode is STRICT on every port: a DENY of
	// connections without a peer identity (istiod's name for it).
	StaticStrictName = "istio_converted_static_strict"
	// peerPolicyPrefix names the policy a workload-level
	// PeerAuthentication with port-level modes becomes.
	peerPolicyPrefix = "istio_converted_peer_authentication_"
)

// PeerObject is one PeerAuthentication as the model reads it.
type PeerObject struct {
	Namespace, Name string
	Created         time.Time
	Spec            *securityv1beta1.PeerAuthentication
}

// Key is the object's <namespace>/<name>.
func (o *PeerObject) Key() string { return o.Namespace + "/" + o.Name }

// ParsePeerObject reads a PeerAuthentication from its JSON. A spec that
// does not decode strictly is an error and no object: the mode it would
// set is unknown, and the workloads keep the mode of the level above.
func ParsePeerObject(raw []byte) (*PeerObject, error) {
	var doc struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
		Spec     json.RawMessage   `json:"spec"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("failed to decode peer authentication: %w", err)
	}
	if doc.Metadata.Name == "" {
		return nil, fmt.Errorf("failed to decode peer authentication: metadata.name is required")
	}
	o := &PeerObject{Namespace: doc.Metadata.Namespace, Name: doc.Metadata.Name, Created: doc.Metadata.CreationTimestamp.Time, Spec: &securityv1beta1.PeerAuthentication{}}
	if o.Namespace == "" {
		o.Namespace = "default"
	}
	if len(doc.Spec) > 0 && string(doc.Spec) != "null" {
		if err := protojson.Unmarshal(doc.Spec, o.Spec); err != nil {
			return nil, fmt.Errorf("peer authentication %s: invalid spec: %w", o.Key(), err)
		}
	}
	return o, nil
}

// mtlsMode is an effective mode: DISABLE is PERMISSIVE in ambient (the
// node proxy cannot send plaintext to a pod that HBONE reaches), UNSET
// inherits.
type mtlsMode uint8

const (
	modeUnset mtlsMode = iota
	modePermissive
	modeStrict
)

func modeOf(m *securityv1beta1.PeerAuthentication_MutualTLS) mtlsMode {
	switch m.GetMode() {
	case securityv1beta1.PeerAuthentication_MutualTLS_STRICT:
		return modeStrict
	case securityv1beta1.PeerAuthentication_MutualTLS_PERMISSIVE, securityv1beta1.PeerAuthentication_MutualTLS_DISABLE:
		return modePermissive
	}
	return modeUnset
}

// oldest returns the oldest of os (then by key: Istio's tie-break is
// creation time, the name makes it total).
func oldest(os []*PeerObject) *PeerObject {
	var best *PeerObject
	for _, o := range os {
		if best == nil || o.Created.Before(best.Created) || (o.Created.Equal(best.Created) && o.Key() < best.Key()) {
			best = o
		}
	}
	return best
}

// peerLevels picks, as Istio does, the mesh-wide (root namespace, no
// selector), the namespace-wide (no selector) and the workload (selector
// matching lbl) PeerAuthentication of a workload of namespace ns: the
// oldest at each level.
func peerLevels(root, ns string, lbl map[string]string, peers map[string]*PeerObject) (mesh, nsWide, wl *PeerObject) {
	var meshes, nss, wls []*PeerObject
	for _, o := range peers {
		sel := o.Spec.GetSelector().GetMatchLabels()
		switch {
		case len(sel) == 0 && o.Namespace == root:
			meshes = append(meshes, o)
		case len(sel) == 0 && o.Namespace == ns:
			nss = append(nss, o)
		case len(sel) > 0 && o.Namespace == ns && ns != root && labels.SelectorFromSet(sel).Matches(labels.Set(lbl)):
			wls = append(wls, o)
		}
	}
	return oldest(meshes), oldest(nss), oldest(wls)
}

// parentMode is the mode the mesh and namespace levels give (PERMISSIVE
// when neither sets one).
func parentMode(mesh, nsWide *PeerObject) mtlsMode {
	mode := modePermissive
	if m := modeOf(mesh.GetSpecMtls()); m != modeUnset {
		mode = m
	}
	if m := modeOf(nsWide.GetSpecMtls()); m != modeUnset {
		mode = m
	}
	return mode
}

// GetSpecMtls is the object's spec.mtls (nil-safe).
func (o *PeerObject) GetSpecMtls() *securityv1beta1.PeerAuthentication_MutualTLS {
	if o == nil {
		return nil
	}
	return o.Spec.GetMtls()
}

// peerBinding returns the policy keys a workload's PeerAuthentications
// bind it to: STRICT everywhere binds the static strict policy; a
// workload-level one with port-level modes binds its own translation
// (convertPeer).
func peerBinding(root, ns string, lbl map[string]string, peers map[string]*PeerObject) []string {
	mesh, nsWide, wl := peerLevels(root, ns, lbl, peers)
	if a := convertPeer(wl, mesh, nsWide); a != nil {
		return []string{a.Namespace + "/" + a.Name}
	}
	mode := parentMode(mesh, nsWide)
	if m := modeOf(wl.GetSpecMtls()); m != modeUnset {
		mode = m
	}
	if mode == modeStrict {
		return []string{root + "/" + StaticStrictName}
	}
	return nil
}

// convertPeer is the Authorization a workload-level PeerAuthentication
// with port-level modes becomes, given the mesh and namespace levels
// above it; nil when its ports change nothing (every port as the
// workload's mode).
func convertPeer(wl, mesh, nsWide *PeerObject) *security.Authorization {
	if wl == nil || len(wl.Spec.GetPortLevelMtls()) == 0 {
		return nil
	}
	mode := parentMode(mesh, nsWide)
	if m := modeOf(wl.GetSpecMtls()); m != modeUnset {
		mode = m
	}
	var strictPorts, openPorts []uint32
	for port, m := range wl.Spec.GetPortLevelMtls() {
		switch modeOf(m) {
		case modeStrict:
			strictPorts = append(strictPorts, port)
		case modePermissive:
			openPorts = append(openPorts, port)
		}
	}
	slices.Sort(strictPorts)
	slices.Sort(openPorts)
	noIdentity := &security.Match{NotPrincipals: []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}}}
	a := &security.Authorization{Name: peerPolicyPrefix + wl.Name, Namespace: wl.Namespace, Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY}
	switch {
	case mode == modeStrict && len(openPorts) > 0:
		// Plaintext is refused except on the permissive ports.
		a.Groups = []*security.Group{{Rules: []*security.Rules{
			{Matches: []*security.Match{noIdentity}},
			{Matches: []*security.Match{{NotDestinationPorts: openPorts}}},
		}}}
	case mode != modeStrict && len(strictPorts) > 0:
		// Plaintext is refused on the strict ports only.
		a.Groups = []*security.Group{{Rules: []*security.Rules{
			{Matches: []*security.Match{noIdentity}},
			{Matches: []*security.Match{{DestinationPorts: strictPorts}}},
		}}}
	default:
		return nil
	}
	return a
}

// staticStrict is the DENY of connections without a peer identity.
func staticStrict(root string) *security.Authorization {
	return &security.Authorization{
		Name: StaticStrictName, Namespace: root, Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			NotPrincipals: []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}},
		}}}}}},
	}
}

// decodeAuthorization decodes a served Authorization (tests, aetherctl).
func decodeAuthorization(b []byte) (*security.Authorization, error) {
	a := &security.Authorization{}
	if err := proto.Unmarshal(b, a); err != nil {
		return nil, fmt.Errorf("failed to decode authorization: %w", err)
	}
	return a, nil
}
