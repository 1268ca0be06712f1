package workloadapi

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"aether.io/node/agent/identity"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/pkg/unixsock"
)

const testToken = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// serveSocket serves st over a real unix socket with o; it returns a client.
func serveSocket(t *testing.T, st Source, o GRPCOptions) workloadpb.SpiffeWorkloadAPIClient {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "run", "workload.sock")
	ln, err := unixsock.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := New(st, nil)
	g, err := NewGRPCServer(srv, o)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(func() { srv.Stop(); g.Stop() })
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return workloadpb.NewSpiffeWorkloadAPIClient(cc)
}

// fetch opens FetchX509SVID on ctx and reads its first message.
func fetch(ctx context.Context, c workloadpb.SpiffeWorkloadAPIClient) error {
	s, err := c.FetchX509SVID(ctx, &workloadpb.X509SVIDRequest{})
	if err == nil {
		_, err = s.Recv()
	}
	return err
}

// withToken adds the Workload API token metadata to ctx.
func withToken(ctx context.Context, tok string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, meshcontract.WorkloadAPITokenMetadata, tok)
}

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
			c := serveSocket(t, st, GRPCOptions{AllowedUIDs: tc.allowed, Token: testToken})
			if err := fetch(withToken(withHeader(testCtx(t)), testToken), c); status.Code(err) != tc.want {
				t.Fatalf("FetchX509SVID: %v; want %v", err, tc.want)
			}
		})
	}
}

// TestTokenRequired: an allowed uid is not enough (aether-proxy relays
// remote clients' bytes as uid 0): a call without the token, or with
// another one, is refused with PermissionDenied naming the metadata key
// and the token file, and counted by reason; with the token it is served,
// on the streams and the unary calls alike.
func TestTokenRequired(t *testing.T) {
	st, _ := newStore(t, time.Hour)
	if err := st.Sync([]identity.Account{{Namespace: "shop", ServiceAccount: "web"}}); err != nil {
		t.Fatal(err)
	}
	rejected := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rejected"}, []string{"reason"})
	const file = "/run/aether/proxy/workload-api.token"
	c := serveSocket(t, st, GRPCOptions{AllowedUIDs: []uint32{uint32(os.Getuid())}, Token: testToken, TokenFile: file, TokenRejected: rejected})
	for _, tc := range []struct {
		name string
		ctx  context.Context
		want codes.Code
		// msg are substrings of a refusal's message.
		msg    []string
		reason string
	}{
		{name: "token", ctx: withToken(withHeader(testCtx(t)), testToken), want: codes.OK},
		{
			name: "no token", ctx: withHeader(testCtx(t)), want: codes.PermissionDenied,
			msg: []string{"token missing", meshcontract.WorkloadAPITokenMetadata, file}, reason: TokenMissing,
		},
		{
			name: "another token", ctx: withToken(withHeader(testCtx(t)), strings.Repeat("f", len(testToken))), want: codes.PermissionDenied,
			msg: []string{"does not match", file}, reason: TokenInvalid,
		},
		{name: "a prefix of the token", ctx: withToken(withHeader(testCtx(t)), testToken[:32]), want: codes.PermissionDenied, reason: TokenInvalid},
		{name: "two tokens, one right", ctx: withToken(withToken(withHeader(testCtx(t)), "x"), testToken), want: codes.PermissionDenied, reason: TokenInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := counterValue(t, rejected.WithLabelValues(tc.reason))
			err := fetch(tc.ctx, c)
			if status.Code(err) != tc.want {
				t.Fatalf("FetchX509SVID: %v; want %v", err, tc.want)
			}
			for _, m := range tc.msg {
				if !strings.Contains(status.Convert(err).Message(), m) {
					t.Errorf("refusal %q does not name %q", err, m)
				}
			}
			if tc.want == codes.OK {
				return
			}
			if got := counterValue(t, rejected.WithLabelValues(tc.reason)); got != before+1 {
				t.Errorf("rejected{reason=%s} = %v, want %v", tc.reason, got, before+1)
			}
			before++
			// Every method is guarded, before it answers.
			s, err := c.FetchJWTBundles(tc.ctx, &workloadpb.JWTBundlesRequest{})
			if err == nil {
				_, err = s.Recv()
			}
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("FetchJWTBundles without the right token: %v; want PermissionDenied", err)
			}
			if got := counterValue(t, rejected.WithLabelValues(tc.reason)); got != before+1 {
				t.Errorf("rejected{reason=%s} after FetchJWTBundles = %v, want %v", tc.reason, got, before+1)
			}
			if _, err := c.ValidateJWTSVID(tc.ctx, &workloadpb.ValidateJWTSVIDRequest{Audience: "a", Svid: "x"}); status.Code(err) != codes.PermissionDenied {
				t.Errorf("ValidateJWTSVID (unary) without the right token: %v; want PermissionDenied", err)
			}
		})
	}
}

// TestShortTokenRefused: a server is never built with an empty or short
// token.
func TestShortTokenRefused(t *testing.T) {
	st, _ := newStore(t, time.Hour)
	for _, tok := range []string{"", "short"} {
		if _, err := NewGRPCServer(New(st, nil), GRPCOptions{Token: tok}); err == nil || !strings.Contains(err.Error(), "invalid workload api token") {
			t.Errorf("NewGRPCServer(token %q) = %v; want an invalid token error", tok, err)
		}
	}
}

// counterValue reads c.
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
