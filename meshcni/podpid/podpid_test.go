package podpid

import (
	"context"
	"errors"
	"maps"
	"net"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func TestFromNetnsPath(t *testing.T) {
	for path, want := range map[string]uint32{
		"/proc/1234/ns/net":          1234,
		"/proc/77/task/78/ns/net":    77,
		"/var/run/netns/cni-1234":    0,
		"/proc/self/ns/net":          0,
		"/proc/1234/ns/net/../../1/": 0,
		"/proc/0/ns/net":             0,
		"/proc/4294967296/ns/net":    0,
		"/proc//ns/net":              0,
		"/proc/12a/ns/net":           0,
		"/proc/77/task//ns/net":      0,
		"/proc/77/task/7x/ns/net":    0,
		"/proc/77/task/78/ns/mnt":    0,
		"/proc/77/ns/net2":           0,
		"proc/77/ns/net":             0,
	} {
		got, ok := FromNetnsPath(path)
		if got != want || ok != (want != 0) {
			t.Errorf("FromNetnsPath(%q) = %d, %v; want %d", path, got, ok, want)
		}
	}
}

type fakeCRI struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	info  map[string]string
	delay time.Duration
}

func (f *fakeCRI) PodSandboxStatus(ctx context.Context, _ *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	select {
	case <-time.After(f.delay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &runtimeapi.PodSandboxStatusResponse{Info: f.info}, nil
}

func serveCRI(t *testing.T, f *fakeCRI) string {
	sock := filepath.Join(t.TempDir(), "cri.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(s, f)
	go s.Serve(l)
	t.Cleanup(s.Stop)
	return "unix://" + sock
}

func TestCRILookup(t *testing.T) {
	c := CRI{Timeout: 300 * time.Millisecond}
	ep := serveCRI(t, &fakeCRI{info: map[string]string{"info": `{"pid": 4242, "sandboxConfig": {}}`}})
	if pid, err := c.Lookup(context.Background(), ep, "sb"); err != nil || pid != 4242 {
		t.Fatalf("Lookup = %d, %v", pid, err)
	}
	ep = serveCRI(t, &fakeCRI{info: map[string]string{"info": `{"pid": 0}`}})
	if _, err := c.Lookup(context.Background(), ep, "sb"); !errors.Is(err, ErrNoPID) {
		t.Fatalf("Lookup without pid = %v, want ErrNoPID", err)
	}
	// A runtime that does not answer in time is cut off by the deadline.
	ep = serveCRI(t, &fakeCRI{delay: time.Minute})
	done := make(chan error, 1)
	go func() { _, err := c.Lookup(context.Background(), ep, "sb"); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Lookup on a stuck runtime succeeded")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Lookup ignored its deadline")
	}
	if _, err := c.Lookup(context.Background(), "unix://"+filepath.Join(t.TempDir(), "none.sock"), "sb"); err == nil {
		t.Fatal("Lookup on a missing socket succeeded")
	}
}

// TestWireCodec checks the hand encoding against k8s.io/cri-api's
// generated messages: the request decodes to the same fields, and every
// shape of response (other fields around info, empty values) yields info.
func TestWireCodec(t *testing.T) {
	b, err := wireCodec{}.Marshal(&statusRequest{sandboxID: "sb-1", verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	var req runtimeapi.PodSandboxStatusRequest
	if err := proto.Unmarshal(b, &req); err != nil || req.GetPodSandboxId() != "sb-1" || !req.GetVerbose() {
		t.Fatalf("request decodes to %v, %v", &req, err)
	}
	for name, tc := range map[string]struct {
		resp *runtimeapi.PodSandboxStatusResponse
		want map[string]string
	}{
		"empty": {&runtimeapi.PodSandboxStatusResponse{}, map[string]string{}},
		"info only": {
			&runtimeapi.PodSandboxStatusResponse{Info: map[string]string{"info": `{"pid":1}`, "pid": "7"}},
			map[string]string{"info": `{"pid":1}`, "pid": "7"},
		},
		"all fields": {&runtimeapi.PodSandboxStatusResponse{
			Status:             &runtimeapi.PodSandboxStatus{Id: "sb", State: runtimeapi.PodSandboxState_SANDBOX_READY, CreatedAt: 42, Labels: map[string]string{"a": "b"}},
			Info:               map[string]string{"info": "{}", "": "empty key", "k": ""},
			ContainersStatuses: []*runtimeapi.ContainerStatus{{Id: "c", ExitCode: 3}},
			Timestamp:          99,
		}, map[string]string{"info": "{}", "": "empty key", "k": ""}},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := proto.Marshal(tc.resp)
			if err != nil {
				t.Fatal(err)
			}
			var got statusResponse
			if err := (wireCodec{}).Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(got.info, tc.want) {
				t.Errorf("info = %v, want %v", got.info, tc.want)
			}
		})
	}
	if err := (wireCodec{}).Unmarshal([]byte{0x12, 0x05, 0x0a}, &statusResponse{}); err == nil {
		t.Error("truncated response decoded without error")
	}
}
