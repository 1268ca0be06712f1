package workload

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	securitypb "aether.io/node/api/istio/security"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/resource"
)

// Sources of the Address index (Index.Addresses) besides the workloads
// mirrored from the workload index: the Services the agent's Service model
// writes (Writer.UpsertService).
const (
	// ServiceSource is the source the Services of the Address index are
	// written as: Addresses().Writer(ServiceSource).
	ServiceSource = "services"
)

// Address field numbers of istio.workload.Address's oneof.
const (
	fieldAddressWorkload protowire.Number = 1
	fieldAddressService  protowire.Number = 2
)

// Addresses returns the Address view of a workload index: the
// istio.workload.Address resources (resource.AddressType) ztunnel and
// aether-proxy subscribe to. Every workload the index serves is mirrored
// into it under the same name (wrapped as Address{workload}, the workload's
// bytes unchanged), and Services are written to it by the source
// ServiceSource under their ServiceName. It is nil for an Address index.
func (x *Index) Addresses() *Index { return x.addr }

// TypeURL is the type of the resources the index serves.
func (x *Index) TypeURL() string { return x.typeURL }

// mirror serves the workload resource r as an Address under name: its
// Address encoding, the same bytes as the workload's (NewResource).
func (x *Index) mirror(name string, r *Resource) {
	body := r.addressBytes()
	if body == nil { // a resource not made by NewResource: wrap a copy
		body = protowire.AppendTag(nil, fieldAddressWorkload, protowire.BytesType)
		body = protowire.AppendBytes(body, r.Body)
	}
	res := newResource(resource.AddressType, name, body)
	x.mu.Lock()
	defer x.mu.Unlock()
	// Straight into the slot table: a mirrored workload has one owner (its
	// workload index's served resource), so it takes no key, claim or
	// owner entry (workload uids and Service names never collide).
	x.putLocked(name, res, time.Now())
}

// unmirror stops serving the mirrored workload name.
func (x *Index) unmirror(name string, now time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if _, claimed := x.claims[name]; claimed {
		return // a Service's name, not a workload's
	}
	x.deleteLocked(name, now)
}

// ServiceName is the resource name of a Service in the Address index,
// "<namespace>/<hostname>", as istiod names it; it is also the key of a
// Workload's services map.
func ServiceName(namespace, hostname string) string { return namespace + "/" + hostname }

// ErrNotAddressIndex is returned when Services are written to an index
// that does not serve Addresses.
var ErrNotAddressIndex = errors.New("services are served only by an Address index (Index.Addresses)")

// ValidateService checks that s can be served: a name, a namespace and a
// hostname; every address of 4 or 16 bytes; every port with a service port.
func ValidateService(s *workloadpb.Service) error {
	if s.GetName() == "" || s.GetNamespace() == "" || s.GetHostname() == "" {
		return fmt.Errorf("invalid service %q/%q: name, namespace and hostname are required", s.GetNamespace(), s.GetName())
	}
	for _, a := range s.GetAddresses() {
		if n := len(a.GetAddress()); n != 4 && n != 16 {
			return fmt.Errorf("invalid service %s: address of %d bytes, want 4 (IPv4) or 16 (IPv6)", ServiceName(s.GetNamespace(), s.GetHostname()), n)
		}
	}
	for _, p := range s.GetPorts() {
		if p.GetServicePort() == 0 || p.GetServicePort() > 65535 || p.GetTargetPort() > 65535 {
			return fmt.Errorf("invalid service %s: port %d -> %d, want a service port in 1-65535 and a target port in 0-65535 (0: named, resolved per endpoint)",
				ServiceName(s.GetNamespace(), s.GetHostname()), p.GetServicePort(), p.GetTargetPort())
		}
	}
	return nil
}

// UpsertService serves s (as Address{service}) under its ServiceName. It
// reports whether anything changed; the writer must be of an Address index.
func (w *Writer) UpsertService(s *workloadpb.Service) (bool, error) {
	if w.x.typeURL != resource.AddressType {
		return false, ErrNotAddressIndex
	}
	if err := ValidateService(s); err != nil {
		return false, err
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Service{Service: s}})
	if err != nil {
		return false, fmt.Errorf("failed to marshal service %s: %w", ServiceName(s.GetNamespace(), s.GetHostname()), err)
	}
	name := ServiceName(s.GetNamespace(), s.GetHostname())
	return w.x.upsertResource(w.source, name, newResource(resource.AddressType, name, body))
}

// RemoveService stops serving the Service namespace/hostname.
func (w *Writer) RemoveService(namespace, hostname string) bool {
	return w.Remove(ServiceName(namespace, hostname))
}

// Membership says which Services a workload is an endpoint of: the
// services map of istio.workload.Workload (ServiceName → ports). The
// returned map is shared and must not be modified by either side after it
// is returned. Services is called with the index locked: it must not call
// the index.
type Membership interface {
	Services(uid string) map[string]*workloadpb.PortList
}

// SetMembership makes every workload upserted from now on carry its
// Services (the upserted message's services map is replaced); call Refresh
// for the workloads whose membership changes later. Set it before the
// first upsert.
func (x *Index) SetMembership(m Membership) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.members = m
}

// Refresh rebuilds the services map of the named workloads (every key
// claiming each uid) from the Membership and serves the ones that changed;
// uids the index does not hold are skipped. It reports how many resources
// changed.
func (x *Index) Refresh(uids []string) (int, error) {
	now := time.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.members == nil {
		return 0, nil
	}
	var errs []error
	changed := 0
	for _, uid := range uids {
		for _, key := range x.claims[uid] {
			e := x.keys[key]
			if e.res == nil {
				continue // a lazy claim not served: bound when it is
			}
			var w workloadpb.Workload
			if err := proto.Unmarshal(e.res.Body, &w); err != nil {
				errs = append(errs, fmt.Errorf("failed to decode served workload %q: %w", uid, err))
				continue
			}
			x.bindLocked(&w)
			r, err := NewResource(&w)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if r.Version == e.res.Version {
				continue
			}
			e.res = r
			changed++
			if x.nameKey[uid] == key {
				x.serveLocked(uid, key, r, now)
			}
		}
	}
	return changed, errors.Join(errs...)
}

// PolicyBinding is the optional part of a Membership that binds workloads
// to selector-scoped authorization policies: Policies returns the keys
// (<namespace>/<name>) a workload's authorization_policies lists, and
// Forget is told when the index no longer serves a uid. Both are called
// with the index locked and must not call it.
type PolicyBinding interface {
	Policies(uid string) []string
	Forget(uid string)
}

// bindLocked sets w's services map and authorization policies from the
// Membership; x.mu is held.
func (x *Index) bindLocked(w *workloadpb.Workload) {
	w.Services = x.members.Services(w.GetUid())
	if b, ok := x.members.(PolicyBinding); ok {
		w.AuthorizationPolicies = b.Policies(w.GetUid())
	}
}

// Authorizations returns the Authorization view of a workload index: the
// istio.security.Authorization resources (resource.AuthorizationType)
// the agent's policy model writes (Writer.UpsertAuthorization), served
// beside the Addresses. Nil for a view.
func (x *Index) Authorizations() *Index { return x.authz }

// AuthorizationSource is the source the policy model writes as:
// Authorizations().Writer(AuthorizationSource).
const AuthorizationSource = "policies"

// ErrNotAuthorizationIndex is returned when a policy is written to an
// index that does not serve Authorizations.
var ErrNotAuthorizationIndex = errors.New("authorizations are served only by an Authorization index (Index.Authorizations)")

// UpsertAuthorization serves a under <namespace>/<name>, the key workloads
// name it by. It reports whether anything changed.
func (w *Writer) UpsertAuthorization(a *securitypb.Authorization) (bool, error) {
	if w.x.typeURL != resource.AuthorizationType {
		return false, ErrNotAuthorizationIndex
	}
	if a.GetName() == "" || a.GetNamespace() == "" {
		return false, fmt.Errorf("invalid authorization %q/%q: name and namespace are required", a.GetNamespace(), a.GetName())
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(a)
	if err != nil {
		return false, fmt.Errorf("failed to marshal authorization %s/%s: %w", a.GetNamespace(), a.GetName(), err)
	}
	name := a.GetNamespace() + "/" + a.GetName()
	return w.x.upsertResource(w.source, name, newResource(resource.AuthorizationType, name, body))
}
