package policy

import (
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	securityv1beta1 "istio.io/api/security/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Kinds and API versions of Istio's security objects the model reads.
const (
	Group                    = "security.istio.io"
	KindAuthorizationPolicy  = "AuthorizationPolicy"
	ResourceAuthorizationPol = "authorizationpolicies"
)

// ParseObject reads an AuthorizationPolicy from its JSON (a whole object:
// metadata and spec). A spec that does not decode strictly (an unknown
// field, a wrong type) is an error naming the object and the field, and
// the object comes back Malformed: the model then serves it failing
// closed, never as a more permissive reading of it.
func ParseObject(raw []byte) (*Object, error) {
	var doc struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
		Spec     json.RawMessage   `json:"spec"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("failed to decode authorization policy: %w", err)
	}
	if doc.Metadata.Name == "" {
		return nil, fmt.Errorf("failed to decode authorization policy: metadata.name is required")
	}
	o := &Object{Namespace: doc.Metadata.Namespace, Name: doc.Metadata.Name, Annotations: doc.Metadata.Annotations, Spec: &securityv1beta1.AuthorizationPolicy{}}
	if o.Namespace == "" {
		o.Namespace = "default"
	}
	if len(doc.Spec) == 0 || string(doc.Spec) == "null" {
		return o, nil
	}
	if err := protojson.Unmarshal(doc.Spec, o.Spec); err != nil {
		o.Malformed = fmt.Errorf("authorization policy %s: invalid spec: %w", o.Key(), err)
		// Keep what can be read (selector, action) to scope the fail-closed
		// policy; its rules are not used.
		lenient := &securityv1beta1.AuthorizationPolicy{}
		if lerr := lenient.UnmarshalJSON(doc.Spec); lerr == nil {
			o.Spec = lenient
		}
		return o, o.Malformed
	}
	return o, nil
}
