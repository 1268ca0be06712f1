package agentclient_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/meshcni/agentclient"
)

// fakeAgent fails the first failN calls of AddPod/RemovePod with failCode.
type fakeAgent struct {
	cniv1grpc.UnimplementedCNIServiceServer
	failN     int32
	failCode  codes.Code
	calls     atomic.Int32
	addResult cniv1.AddPodResponse_Result
	hang      bool
	// annotations are GetPod's pod annotations (to make the answer big).
	annotations map[string]string
	reports     atomic.Int32
}

func (f *fakeAgent) ReportAddResult(context.Context, *cniv1.ReportAddResultRequest) (*cniv1.ReportAddResultResponse, error) {
	if f.reports.Add(1); f.failCode == codes.Unimplemented {
		return nil, status.Error(codes.Unimplemented, "injected")
	}
	return &cniv1.ReportAddResultResponse{}, nil
}

func (f *fakeAgent) fail(ctx context.Context) error {
	n := f.calls.Add(1)
	if f.hang {
		<-ctx.Done()
		return ctx.Err()
	}
	if n <= f.failN {
		return status.Error(f.failCode, "injected")
	}
	return nil
}

func (f *fakeAgent) AddPod(ctx context.Context, _ *cniv1.AddPodRequest) (*cniv1.AddPodResponse, error) {
	if err := f.fail(ctx); err != nil {
		return nil, err
	}
	return &cniv1.AddPodResponse{Result: f.addResult}, nil
}

func (f *fakeAgent) RemovePod(ctx context.Context, _ *cniv1.RemovePodRequest) (*cniv1.RemovePodResponse, error) {
	if err := f.fail(ctx); err != nil {
		return nil, err
	}
	return &cniv1.RemovePodResponse{Result: cniv1.RemovePodResponse_RESULT_IGNORED}, nil
}

func (f *fakeAgent) GetPod(_ context.Context, r *cniv1.GetPodRequest) (*cniv1.GetPodResponse, error) {
	if r.GetContainerId() == "known" {
		return &cniv1.GetPodResponse{Managed: true, Pod: &cniv1.CNIPod{ContainerId: "known", Annotations: f.annotations}}, nil
	}
	return nil, status.Error(codes.NotFound, "no record")
}

func serve(t *testing.T, srv cniv1grpc.CNIServiceServer) string {
	t.Helper()
	sock, _ := serveCounting(t, srv)
	return sock
}

// serveCounting serves srv with grpc-go on a unix socket and counts the
// connections it accepts.
func serveCounting(t *testing.T, srv cniv1grpc.CNIServiceServer) (string, *atomic.Int32) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cni.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	cl := &countingListener{Listener: l}
	s := grpc.NewServer()
	cniv1grpc.RegisterCNIServiceServer(s, srv)
	go s.Serve(cl)
	t.Cleanup(s.Stop)
	return sock, &cl.accepted
}

type countingListener struct {
	net.Listener
	accepted atomic.Int32
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
	}
	return c, err
}

func client(t *testing.T, sock string, attempts int) *agentclient.Client {
	t.Helper()
	c, err := agentclient.New(sock, agentclient.Options{Timeout: 300 * time.Millisecond, Attempts: attempts, Backoff: 10 * time.Millisecond, ReportTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestAddPodRetries(t *testing.T) {
	for _, tc := range []struct {
		name      string
		failN     int32
		code      codes.Code
		attempts  int
		wantCalls int32
		wantErr   error // nil, ErrUnavailable, or errOther
	}{
		{"unavailable then ok", 2, codes.Unavailable, 3, 3, nil},
		{"deadline then ok", 1, codes.DeadlineExceeded, 3, 2, nil},
		{"unavailable exhausts attempts", 5, codes.Unavailable, 3, 3, agentclient.ErrUnavailable},
		{"invalid argument is not retried", 1, codes.InvalidArgument, 3, 1, errOther},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeAgent{failN: tc.failN, failCode: tc.code, addResult: cniv1.AddPodResponse_RESULT_SUCCESS}
			c := client(t, serve(t, f), tc.attempts)
			res, err := c.AddPod(context.Background(), &agentclient.AddPodRequest{Pod: &agentclient.Pod{Name: "p", Namespace: "n"}})
			if got := f.calls.Load(); got != tc.wantCalls {
				t.Errorf("calls = %d, want %d", got, tc.wantCalls)
			}
			switch {
			case tc.wantErr == nil:
				if err != nil || res != agentclient.AddSuccess {
					t.Fatalf("AddPod = %v, %v", res, err)
				}
			case errors.Is(tc.wantErr, errOther):
				if err == nil || errors.Is(err, agentclient.ErrUnavailable) {
					t.Fatalf("AddPod err = %v, want a non-retryable error", err)
				}
			default:
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("AddPod err = %v, want %v", err, tc.wantErr)
				}
			}
		})
	}
}

var errOther = errors.New("other")

func TestAgentDownIsBoundedAndUnavailable(t *testing.T) {
	c := client(t, filepath.Join(t.TempDir(), "absent.sock"), 3)
	_, err := c.RemovePod(context.Background(), &agentclient.RemovePodRequest{Name: "p", Namespace: "n", ContainerID: "c"})
	if !errors.Is(err, agentclient.ErrUnavailable) {
		t.Fatalf("RemovePod with no agent = %v, want ErrUnavailable", err)
	}
	if err := c.Ready(context.Background()); !errors.Is(err, agentclient.ErrUnavailable) {
		t.Fatalf("Ready with no agent = %v", err)
	}
}

func TestHangingAgentHitsDeadline(t *testing.T) {
	f := &fakeAgent{hang: true}
	c := client(t, serve(t, f), 2)
	_, err := c.AddPod(context.Background(), &agentclient.AddPodRequest{Pod: &agentclient.Pod{Name: "p", Namespace: "n"}})
	if !errors.Is(err, agentclient.ErrUnavailable) {
		t.Fatalf("AddPod on a hanging agent = %v, want ErrUnavailable after its deadlines", err)
	}
	if f.calls.Load() != 2 {
		t.Fatalf("calls = %d, want 2 (DeadlineExceeded is retried)", f.calls.Load())
	}
}

func TestReportUnimplementedIgnored(t *testing.T) {
	c := client(t, serve(t, &fakeAgent{failCode: codes.Unimplemented}), 1)
	if err := c.ReportAddResult(context.Background(), &agentclient.ReportRequest{ContainerID: "c"}); err != nil {
		t.Fatalf("ReportAddResult on an agent without it = %v, want nil", err)
	}
}

func TestGetPod(t *testing.T) {
	c := client(t, serve(t, &fakeAgent{}), 1)
	if r, err := c.GetPod(context.Background(), "known"); err != nil || !r.Managed {
		t.Fatalf("GetPod(known) = %v, %v", r, err)
	}
	if _, err := c.GetPod(context.Background(), "other"); !errors.Is(err, agentclient.ErrNotFound) {
		t.Fatalf("GetPod(other) = %v, want ErrNotFound", err)
	}
	if err := c.Ready(context.Background()); err != nil {
		t.Fatalf("Ready = %v", err)
	}
}

// TestMethodNames: the client's method names are the generated service's.
func TestMethodNames(t *testing.T) {
	for got, want := range map[string]string{
		agentclient.MethodAddPod:          cniv1grpc.CNIService_AddPod_FullMethodName,
		agentclient.MethodRemovePod:       cniv1grpc.CNIService_RemovePod_FullMethodName,
		agentclient.MethodReportAddResult: cniv1grpc.CNIService_ReportAddResult_FullMethodName,
		agentclient.MethodGetPod:          cniv1grpc.CNIService_GetPod_FullMethodName,
	} {
		if got != want {
			t.Errorf("method %q, the service has %q", got, want)
		}
	}
}

// TestOneConnectionPerAdd: AddPod and ReportAddResult of one ADD (after
// Connect, as the plugin calls them) share one connection.
func TestOneConnectionPerAdd(t *testing.T) {
	f := &fakeAgent{addResult: cniv1.AddPodResponse_RESULT_SUCCESS}
	sock, accepted := serveCounting(t, f)
	c := client(t, sock, 3)
	c.Connect()
	if res, err := c.AddPod(context.Background(), &agentclient.AddPodRequest{Pod: &agentclient.Pod{Name: "p", Namespace: "n"}}); err != nil || res != agentclient.AddSuccess {
		t.Fatalf("AddPod = %v, %v", res, err)
	}
	if err := c.ReportAddResult(context.Background(), &agentclient.ReportRequest{ContainerID: "c"}); err != nil {
		t.Fatalf("ReportAddResult = %v", err)
	}
	if n := f.reports.Load(); n != 1 {
		t.Fatalf("agent got %d reports, want 1", n)
	}
	if n := accepted.Load(); n != 1 {
		t.Fatalf("the calls used %d connections, want 1", n)
	}
}

// TestLargeResponse: a GetPod answer far larger than HTTP/2's initial
// flow-control window (a pod with 300 KiB of annotations, more than the API
// server allows) arrives whole.
func TestLargeResponse(t *testing.T) {
	ann := map[string]string{}
	for i := range 300 {
		ann[fmt.Sprintf("example.com/a%d", i)] = strings.Repeat("x", 1024)
	}
	// A generous deadline: a stall (a window never refilled) fails it,
	// a busy machine does not.
	c, err := agentclient.New(serve(t, &fakeAgent{annotations: ann}), agentclient.Options{Timeout: 20 * time.Second, Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	for range 2 { // the second answer rides the windows the first refilled
		r, err := c.GetPod(context.Background(), "known")
		if err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(r.Pod.Annotations, ann) {
			t.Fatalf("GetPod returned %d annotations, want %d", len(r.Pod.Annotations), len(ann))
		}
	}
}

// TestManyCallsOneConnection: requests adding up to several times HTTP/2's
// initial connection window go through on one connection (the client
// counts the window down and back up with the agent's WINDOW_UPDATEs).
func TestManyCallsOneConnection(t *testing.T) {
	f := &fakeAgent{}
	sock, accepted := serveCounting(t, f)
	c := client(t, sock, 1)
	req := &agentclient.ReportRequest{ContainerID: "c", Timings: &agentclient.Timings{
		ReadinessProbeError: strings.Repeat("r", 4096), CaptureDivertError: strings.Repeat("d", 4096),
	}}
	for i := range 40 { // 40 x 8 KiB: five times the 64 KiB window
		if err := c.ReportAddResult(context.Background(), req); err != nil {
			t.Fatalf("report %d: %v", i, err)
		}
	}
	if n := f.reports.Load(); n != 40 {
		t.Fatalf("agent got %d reports, want 40", n)
	}
	if n := accepted.Load(); n != 1 {
		t.Fatalf("the calls used %d connections, want 1", n)
	}
}

// TestReconnectsAfterAgentRestart: a call after the agent restarted (its
// connection gone) dials again and succeeds.
func TestReconnectsAfterAgentRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "cni.sock")
	start := func() *grpc.Server {
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		s := grpc.NewServer()
		cniv1grpc.RegisterCNIServiceServer(s, &fakeAgent{})
		go s.Serve(l)
		return s
	}
	s := start()
	c := client(t, sock, 3)
	if err := c.Ready(context.Background()); err != nil {
		t.Fatalf("Ready = %v", err)
	}
	s.Stop()
	if err := c.Ready(context.Background()); !errors.Is(err, agentclient.ErrUnavailable) {
		t.Fatalf("Ready with the agent stopped = %v, want ErrUnavailable", err)
	}
	s = start()
	t.Cleanup(s.Stop)
	if err := c.Ready(context.Background()); err != nil {
		t.Fatalf("Ready after the agent restarted = %v", err)
	}
}
