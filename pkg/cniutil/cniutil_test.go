package cniutil

import (
	"errors"
	"fmt"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

func TestParseK8sArgsAnyOrder(t *testing.T) {
	for _, in := range []string{
		"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1",
		"K8S_POD_UID=u-1;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_NAME=web;IgnoreUnknown=1;K8S_POD_NAMESPACE=ns",
		"K8S_POD_NAME=web;;K8S_POD_NAMESPACE=ns;K8S_POD_UID=u-1;K8S_POD_INFRA_CONTAINER_ID=abc;",
	} {
		got, err := ParseK8sArgs(in)
		if err != nil {
			t.Fatalf("%q: %v", in, err)
		}
		want := K8sArgs{PodName: "web", PodNamespace: "ns", InfraContainerID: "abc", PodUID: "u-1"}
		if got != want {
			t.Fatalf("%q: got %+v want %+v", in, got, want)
		}
	}
}

func TestParseK8sArgsValueWithEquals(t *testing.T) {
	got, err := ParseK8sArgs("K8S_POD_NAME=a=b")
	if err != nil || got.PodName != "a=b" {
		t.Fatalf("got %+v, %v", got, err)
	}
}

func TestParseK8sArgsRejectsBarePair(t *testing.T) {
	if _, err := ParseK8sArgs("K8S_POD_NAME"); err == nil {
		t.Fatal("a pair without '=' must be rejected")
	}
}

func TestContainerIDFallback(t *testing.T) {
	if got := (K8sArgs{}).ContainerID("cni-id"); got != "cni-id" {
		t.Fatalf("fallback not used: %q", got)
	}
	if got := (K8sArgs{InfraContainerID: "infra"}).ContainerID("cni-id"); got != "infra" {
		t.Fatalf("infra ID not preferred: %q", got)
	}
}

func TestAsCNIErrorCodes(t *testing.T) {
	cases := []struct {
		err  error
		code uint
	}{
		{InvalidConfigf("mtu %d is above the master's %d", 9000, 1500), types.ErrInvalidNetworkConfig},
		{fmt.Errorf("failed to reach agent: %w", TryAgainf("agent socket %q not answering", "/run/x")), types.ErrTryAgainLater},
		{errors.New("boom"), types.ErrInternal},
		{&types.Error{Code: 3, Msg: "unknown container"}, 3},
	}
	for _, c := range cases {
		got := AsCNIError(c.err)
		if got.Code != c.code {
			t.Errorf("%v: code %d, want %d", c.err, got.Code, c.code)
		}
		if got.Msg == "" {
			t.Errorf("%v: empty message", c.err)
		}
	}
	if AsCNIError(nil) != nil {
		t.Error("nil must stay nil")
	}
}
