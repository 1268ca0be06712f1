// Package uds resolves the host path of a pod's UDS-delivered socket from
// its stored record alone (no API call, so storage replay works):
//
//	endpoint.aether.io/uds-socket: <volume>/<file>  →  <uds-csi-root>/<uid>/<file>
//
// The volume must be the pod's single inline csi volume of driver
// csi.aether.io. Refusals carry a reason: not_csi, volume_not_declared,
// multiple_csi_volumes, invalid_path, missing_uid.
package uds

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/meshcontract"
)

// Annotation names the pod's UDS socket as <volume>/<file>.
const Annotation = "endpoint.aether.io/uds-socket"

// MaxSunPath is the usable length of sockaddr_un.sun_path (108 bytes
// including the terminating NUL).
const MaxSunPath = 107

// Refusal reasons.
const (
	ReasonNotCSI             = "not_csi"
	ReasonVolumeNotDeclared  = "volume_not_declared"
	ReasonMultipleCSIVolumes = "multiple_csi_volumes"
	ReasonInvalidPath        = "invalid_path"
	ReasonMissingUID         = "missing_uid"
)

// Reasons lists every refusal reason (for metric pre-registration).
var Reasons = []string{ReasonNotCSI, ReasonVolumeNotDeclared, ReasonMultipleCSIVolumes, ReasonInvalidPath, ReasonMissingUID}

// RefusalError says why a UDS request was refused.
type RefusalError struct {
	// Reason is one of the Reason constants.
	Reason string
	// Detail is a human-readable explanation.
	Detail string
}

func (e *RefusalError) Error() string { return "uds socket refused (" + e.Reason + "): " + e.Detail }

func refuse(reason, format string, a ...any) error {
	return &RefusalError{Reason: reason, Detail: fmt.Sprintf(format, a...)}
}

// ValidSegment reports whether s is a single clean path segment: non-empty,
// not "." or "..", no "/" and no NUL.
func ValidSegment(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, "/\x00")
}

// Resolve returns the socket path for pod under root. ok is false (and err
// nil) when the pod does not ask for a UDS socket.
func Resolve(root string, pod *cniv1.CNIPod) (path string, ok bool, err error) {
	spec, asked := pod.GetAnnotations()[Annotation]
	if !asked {
		return "", false, nil
	}
	vol, file, cut := strings.Cut(spec, "/")
	if !cut || !ValidSegment(vol) || !ValidSegment(file) {
		return "", true, refuse(ReasonInvalidPath, "annotation %s=%q must be <volume>/<file> with two single path segments (no '/', '..', '.' or NUL)", Annotation, spec)
	}
	uid := pod.GetUid()
	if uid == "" {
		return "", true, refuse(ReasonMissingUID, "the record of pod %s/%s has no uid (written before uids were stored)", pod.GetNamespace(), pod.GetName())
	}
	if !ValidSegment(uid) {
		return "", true, refuse(ReasonInvalidPath, "pod uid %q is not a single path segment", uid)
	}
	if pod.GetUdsCsiVolumes() > 1 {
		return "", true, refuse(ReasonMultipleCSIVolumes, "pod declares %d %s volumes; exactly one is allowed", pod.GetUdsCsiVolumes(), "csi.aether.io")
	}
	if pod.GetUdsCsiVolume() != vol {
		if slices.Contains(pod.GetVolumes(), vol) {
			return "", true, refuse(ReasonNotCSI, "volume %q is not an inline csi volume of driver csi.aether.io", vol)
		}
		return "", true, refuse(ReasonVolumeNotDeclared, "pod does not declare volume %q", vol)
	}
	if root == "" || !filepath.IsAbs(root) || filepath.Clean(root) != root && filepath.Clean(root)+"/" != root {
		return "", true, refuse(ReasonInvalidPath, "uds csi root %q must be a clean absolute path", root)
	}
	p := filepath.Join(meshcontract.PodSocketDir(root, uid), file)
	if len(p) > MaxSunPath {
		return "", true, refuse(ReasonInvalidPath, "socket path %q is %d bytes, over the %d-byte sun_path limit", p, len(p), MaxSunPath)
	}
	return p, true, nil
}
