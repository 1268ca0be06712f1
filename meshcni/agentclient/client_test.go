package agentclient_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/meshcni/agentclient"
)

// fakeAgent fails the first failN calls of AddPod/RemovePod with failCode.
type fakeAgent struct {
	cniv1.UnimplementedCNIServiceServer
	failN     int32
	failCode  codes.Code
	calls     atomic.Int32
	addResult cniv1.AddPodResponse_Result
	hang      bool
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
		return &cniv1.GetPodResponse{Managed: true, Pod: &cniv1.CNIPod{ContainerId: "known"}}, nil
	}
	return nil, status.Error(codes.NotFound, "no record")
}

func serve(t *testing.T, srv cniv1.CNIServiceServer) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cni.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	cniv1.RegisterCNIServiceServer(s, srv)
	go s.Serve(l)
	t.Cleanup(s.Stop)
	return sock
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
			res, err := c.AddPod(context.Background(), &cniv1.AddPodRequest{Pod: &cniv1.CNIPod{Name: "p", Namespace: "n"}})
			if got := f.calls.Load(); got != tc.wantCalls {
				t.Errorf("calls = %d, want %d", got, tc.wantCalls)
			}
			switch {
			case tc.wantErr == nil:
				if err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS {
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
	_, err := c.RemovePod(context.Background(), &cniv1.RemovePodRequest{Name: "p", Namespace: "n", ContainerId: "c"})
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
	_, err := c.AddPod(context.Background(), &cniv1.AddPodRequest{Pod: &cniv1.CNIPod{Name: "p", Namespace: "n"}})
	if !errors.Is(err, agentclient.ErrUnavailable) {
		t.Fatalf("AddPod on a hanging agent = %v, want ErrUnavailable after its deadlines", err)
	}
	if f.calls.Load() != 2 {
		t.Fatalf("calls = %d, want 2 (DeadlineExceeded is retried)", f.calls.Load())
	}
}

func TestReportUnimplementedIgnored(t *testing.T) {
	c := client(t, serve(t, &fakeAgent{}), 1)
	if err := c.ReportAddResult(context.Background(), &cniv1.ReportAddResultRequest{ContainerId: "c"}); err != nil {
		t.Fatalf("ReportAddResult on an agent without it = %v, want nil", err)
	}
}

func TestGetPod(t *testing.T) {
	c := client(t, serve(t, &fakeAgent{}), 1)
	if r, err := c.GetPod(context.Background(), "known"); err != nil || !r.GetManaged() {
		t.Fatalf("GetPod(known) = %v, %v", r, err)
	}
	if _, err := c.GetPod(context.Background(), "other"); !errors.Is(err, agentclient.ErrNotFound) {
		t.Fatalf("GetPod(other) = %v, want ErrNotFound", err)
	}
	if err := c.Ready(context.Background()); err != nil {
		t.Fatalf("Ready = %v", err)
	}
}
