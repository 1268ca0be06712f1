package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"aether.io/node/pkg/adminapi"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// serveAdmin answers GET /v1/pods/{ns}/{name} on a unix socket with pods
// (or with notFound when pods is empty), as the agent's admin API does.
func serveAdmin(t *testing.T, pods []adminapi.Pod, notFound *adminapi.NotFound) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if len(pods) == 0 {
			w.WriteHeader(http.StatusNotFound)
			_ = json.NewEncoder(w).Encode(notFound)
			return
		}
		_ = json.NewEncoder(w).Encode(pods)
	})}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return sock
}

// TestRunPod renders `aetherctl pod` against golden text: the last ADD's
// timings, the last DEL of an earlier sandbox, and a pod with no record
// left whose last DEL the agent still knows.
func TestRunPod(t *testing.T) {
	at := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	del := &adminapi.Removal{ContainerID: "cid-old", At: at.Add(-time.Minute), Timings: map[string]string{
		"started": "2026-11-30T09:58:59.9Z", "pre_call": "1.2ms",
	}}
	pod := adminapi.Pod{
		Namespace: "shop", Name: "web-1", ContainerID: "cid-new", UID: "uid-1", IPs: []string{"10.1.0.5"},
		NetworkNS: "/run/aether/netns/cid-new", ServiceAccount: "web", Owner: "ReplicaSet/web-5d4b8c", Managed: true, Registered: true, Healthy: true,
		AddedAt: at, EnrolledVia: "namespace_label", LastDel: del, LastTimings: map[string]string{
			"started": "2026-11-30T09:59:59.9Z", "pre_call": "2ms", "capture_divert": "1ms", "total": "9ms",
		},
	}
	pod.InboundPolicy = "permissive"
	withID := pod
	withID.SPIFFEID = "spiffe://cluster.local/ns/shop/sa/web"
	withID.LastDel = nil
	withID.DeclaredPortsKnown, withID.DeclaredTCPPorts = true, []uint32{80, 8080}
	invalid := withID
	invalid.InboundPolicy, invalid.InboundPolicyInvalid = "strict", true
	invalid.DeclaredTCPPorts = nil // declares none
	for _, tc := range []struct {
		name, golden string
		pods         []adminapi.Pod
		notFound     *adminapi.NotFound
		wantErr      string
	}{
		{name: "pod with the DEL of an earlier sandbox", golden: "pod.golden", pods: []adminapi.Pod{pod}},
		{name: "pod with a SPIFFE ID (identity on)", golden: "pod-spiffe.golden", pods: []adminapi.Pod{withID}},
		{name: "pod with an invalid inbound policy annotation", golden: "pod-policy-invalid.golden", pods: []adminapi.Pod{invalid}},
		{
			name: "no record, last DEL known", notFound: &adminapi.NotFound{Error: "no record", LastDel: del},
			wantErr: "the agent has no record of pod shop/web-1; its last DEL: container cid-old at 2026-11-30T09:59:00Z, pre call 1.2ms",
		},
		{
			name: "no record from an agent without NotFound", notFound: nil,
			wantErr: "the agent has no record of pod shop/web-1",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := serveAdmin(t, tc.pods, tc.notFound)
			var out bytes.Buffer
			err := RunPod(context.Background(), []string{"--admin-socket", sock, "shop/web-1"}, &out)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join("testdata", tc.golden)
			if *update {
				if err := os.WriteFile(path, out.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("missing golden (run go test ./ctl -update): %v", err)
			}
			if !bytes.Equal(out.Bytes(), want) {
				t.Fatalf("aetherctl pod:\n%s\nwant:\n%s", out.Bytes(), want)
			}
		})
	}
}

func TestParseAdminFlagsInterspersed(t *testing.T) {
	tests := []struct {
		args    []string
		pos     []string
		output  string
		wantErr string
	}{
		{args: []string{"-o", "json", "shop/web"}, pos: []string{"shop/web"}, output: "json"},
		{args: []string{"shop/web", "-o", "json"}, pos: []string{"shop/web"}, output: "json"},
		{args: []string{"shop/web", "--admin-socket", "/x.sock", "-o=json", "extra"}, pos: []string{"shop/web", "extra"}, output: "json"},
		{args: []string{"-o", "table", "--", "-o"}, pos: []string{"-o"}, output: "table"},
		{args: []string{"shop/web"}, pos: []string{"shop/web"}, output: "table"},
		{args: []string{"shop/web", "-o", "yaml"}, wantErr: `invalid -o "yaml": want table or json`},
		{args: []string{"shop/web", "-nope"}, wantErr: "flag provided but not defined: -nope"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			f, pos, err := parseAdminFlags("aetherctl pod", tt.args, io.Discard, nil)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !slices.Equal(pos, tt.pos) || f.output != tt.output {
				t.Fatalf("got %q, -o %q, %v; want %q, -o %q", pos, f.output, err, tt.pos, tt.output)
			}
		})
	}
}
