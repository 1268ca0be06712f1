// Package cniutil holds what both CNI plugins of this module share at their
// boundary with the runtime: CNI_ARGS parsing (containerd passes the keys in
// any order), the mapping of errors to CNI error codes, and the verb table
// (PluginMain: skel dispatch, VERSION, about text, exit code).
//
// Codes: 7 invalid network config (the user must fix the netconf), 11 try
// again later (a daemon the plugin needs is not there yet), 999 internal.
// Errors are built lower-case and wrapped inside the plugin; the boundary
// (skel's callbacks, built by Funcs) turns them into *types.Error with
// AsCNIError.
package cniutil

import (
	"errors"
	"fmt"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
)

// K8sArgs are the Kubernetes keys containerd and CRI-O put in CNI_ARGS.
type K8sArgs struct {
	// PodName is K8S_POD_NAME.
	PodName string
	// PodNamespace is K8S_POD_NAMESPACE.
	PodNamespace string
	// InfraContainerID is K8S_POD_INFRA_CONTAINER_ID (the sandbox ID).
	InfraContainerID string
	// PodUID is K8S_POD_UID (containerd 1.6+, CRI-O).
	PodUID string
}

// ParseK8sArgs parses CNI_ARGS ("K=V;K=V"), in any key order, splitting each
// pair on its first '='. Unknown keys are ignored, as IgnoreUnknown=1 asks.
// A pair without '=' is an error that names it.
func ParseK8sArgs(cniArgs string) (K8sArgs, error) {
	var a K8sArgs
	if cniArgs == "" {
		return a, nil
	}
	for pair := range strings.SplitSeq(cniArgs, ";") {
		if pair == "" {
			continue
		}
		k, v, ok := strings.Cut(pair, "=")
		if !ok {
			return K8sArgs{}, fmt.Errorf("invalid CNI_ARGS pair %q: want KEY=VALUE pairs separated by ';'", pair)
		}
		switch strings.TrimSpace(k) {
		case "K8S_POD_NAME":
			a.PodName = v
		case "K8S_POD_NAMESPACE":
			a.PodNamespace = v
		case "K8S_POD_INFRA_CONTAINER_ID":
			a.InfraContainerID = v
		case "K8S_POD_UID":
			a.PodUID = v
		}
	}
	return a, nil
}

// ContainerID returns the sandbox ID: K8S_POD_INFRA_CONTAINER_ID when the
// runtime passed it, else CNI_CONTAINERID (given as fallback).
func (a K8sArgs) ContainerID(fallback string) string {
	if a.InfraContainerID != "" {
		return a.InfraContainerID
	}
	return fallback
}

// Error classes a plugin returns inside its logic; AsCNIError maps them.
var (
	// ErrInvalidConfig marks a problem the user must fix in the netconf (code 7).
	ErrInvalidConfig = errors.New("invalid network configuration")
	// ErrTryAgainLater marks a transient condition, for example a daemon not
	// answering yet (code 11).
	ErrTryAgainLater = errors.New("try again later")
)

// InvalidConfigf returns an error of class ErrInvalidConfig.
func InvalidConfigf(format string, args ...any) error {
	return &classified{class: ErrInvalidConfig, err: fmt.Errorf(format, args...)}
}

// TryAgainf returns an error of class ErrTryAgainLater.
func TryAgainf(format string, args ...any) error {
	return &classified{class: ErrTryAgainLater, err: fmt.Errorf(format, args...)}
}

type classified struct {
	class error
	err   error
}

func (c *classified) Error() string   { return c.err.Error() }
func (c *classified) Unwrap() []error { return []error{c.class, c.err} }

// AsCNIError converts err into the *types.Error the runtime reads: an
// existing *types.Error keeps its code, ErrInvalidConfig maps to 7,
// ErrTryAgainLater to 11, anything else to 999. nil stays nil.
func AsCNIError(err error) *types.Error {
	if err == nil {
		return nil
	}
	var te *types.Error
	if errors.As(err, &te) {
		return te
	}
	code := types.ErrInternal
	switch {
	case errors.Is(err, ErrInvalidConfig):
		code = types.ErrInvalidNetworkConfig
	case errors.Is(err, ErrTryAgainLater):
		code = types.ErrTryAgainLater
	}
	return &types.Error{Code: code, Msg: err.Error()}
}
