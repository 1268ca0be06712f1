package workloadapi

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"aether.io/node/agent/identity"
	"aether.io/node/pkg/unixsock"
)

// TestPeerUIDChecked: over a real unix socket, a caller whose uid is not
// allowed is refused with PermissionDenied; an allowed one is served.
func TestPeerUIDChecked(t *testing.T) {
	st, _ := newStore(t, time.Hour)
	if err := st.Sync([]identity.Account{{Namespace: "shop", ServiceAccount: "web"}}); err != nil {
		t.Fatal(err)
	}
	me := uint32(os.Getuid())
	tests := []struct {
		name    string
		allowed []uint32
		want    codes.Code
	}{
		{"allowed", []uint32{me}, codes.OK},
		{"refused", []uint32{me + 4242}, codes.PermissionDenied},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "run", "workload.sock")
			ln, err := unixsock.Listen(sock)
			if err != nil {
				t.Fatal(err)
			}
			srv := New(st, nil)
			g := NewGRPCServer(srv, GRPCOptions{AllowedUIDs: tc.allowed})
			go func() { _ = g.Serve(ln) }()
			t.Cleanup(func() { srv.Stop(); g.Stop() })
			cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = cc.Close() })
			s, err := workloadpb.NewSpiffeWorkloadAPIClient(cc).FetchX509SVID(withHeader(testCtx(t)), &workloadpb.X509SVIDRequest{})
			if err == nil {
				_, err = s.Recv()
			}
			if status.Code(err) != tc.want {
				t.Fatalf("FetchX509SVID: %v; want %v", err, tc.want)
			}
		})
	}
}
