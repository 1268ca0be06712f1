// Package meshcnitest holds what the tests and benchmarks that exec
// aether-cni share (meshcni's own, test/closergain): an agent that answers
// at once and a primary plugin's result to chain onto.
package meshcnitest

import (
	"context"
	"net"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
)

// PrevResult is a primary plugin's result (eth0, one IPv4 and one IPv6
// address) for aether-cni's prevResult.
const PrevResult = `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"address":"10.1.0.5/24","interface":0},{"address":"fd10::5/64","interface":0}]}`

// minimalAgent answers every CNIService call at once, with success: a
// benchmark then measures the plugin's side only.
type minimalAgent struct {
	cniv1grpc.UnimplementedCNIServiceServer
}

func (minimalAgent) AddPod(context.Context, *cniv1.AddPodRequest) (*cniv1.AddPodResponse, error) {
	return &cniv1.AddPodResponse{Result: cniv1.AddPodResponse_RESULT_SUCCESS}, nil
}

func (minimalAgent) RemovePod(context.Context, *cniv1.RemovePodRequest) (*cniv1.RemovePodResponse, error) {
	return &cniv1.RemovePodResponse{Result: cniv1.RemovePodResponse_RESULT_SUCCESS}, nil
}

func (minimalAgent) ReportAddResult(context.Context, *cniv1.ReportAddResultRequest) (*cniv1.ReportAddResultResponse, error) {
	return &cniv1.ReportAddResultResponse{}, nil
}

// ServeAgent serves a CNIService that answers every call at once, with
// success, on a unix socket in dir until tb ends, and returns the socket's
// path (aether-cni's agent_socket).
func ServeAgent(tb testing.TB, dir string) string {
	tb.Helper()
	sock := filepath.Join(dir, "cni.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		tb.Fatal(err)
	}
	srv := grpc.NewServer()
	cniv1grpc.RegisterCNIServiceServer(srv, minimalAgent{})
	go func() { _ = srv.Serve(l) }()
	tb.Cleanup(srv.Stop)
	return sock
}
