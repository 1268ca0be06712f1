package ctl

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// flowLines are what a proxy sends: its answer, an open, a clean close
// over mutual TLS through a Service, a drop notice, a close a policy
// refused, a limit refusal to an address outside the mesh.
var flowLines = []string{
	`{"type":"subscribed","queue":4096}`,
	`{"type":"opened","reporter":"source","start_time":"2026-11-30T10:00:00.123456789Z","end_time":"","duration_ms":0,"src_addr":"10.1.0.5:40000","src_workload":"web","src_pod":"web-1","src_namespace":"shop","src_principal":"spiffe://cluster.local/ns/shop/sa/web","dst_addr":"10.1.0.9:5432","dst_workload":"db","dst_pod":"db-0","dst_namespace":"data","dst_principal":"spiffe://cluster.local/ns/data/sa/db","dst_service":"db.data.svc.cluster.local","bytes_to_dst":0,"bytes_to_src":0,"path":"hbone","security":"mutual_tls","policy_decision":"none","policy":"","policy_reason":"","policy_dry_run":"","reason":"","limit":"","response_flags":"","error":""}`,
	`{"type":"closed","reporter":"source","start_time":"2026-11-30T10:00:00.123456789Z","end_time":"2026-11-30T10:00:01.5Z","duration_ms":1376.543,"src_addr":"10.1.0.5:40000","src_workload":"web","src_pod":"web-1","src_namespace":"shop","src_principal":"spiffe://cluster.local/ns/shop/sa/web","dst_addr":"10.1.0.9:5432","dst_workload":"db","dst_pod":"db-0","dst_namespace":"data","dst_principal":"spiffe://cluster.local/ns/data/sa/db","dst_service":"db.data.svc.cluster.local","bytes_to_dst":512,"bytes_to_src":20480,"path":"hbone","security":"mutual_tls","policy_decision":"none","policy":"","policy_reason":"","policy_dry_run":"","reason":"client_closed","limit":"","response_flags":"-","error":""}`,
	`{"type":"dropped","dropped":12}`,
	`{"type":"closed","reporter":"destination","start_time":"2026-11-30T10:00:02Z","end_time":"2026-11-30T10:00:02Z","duration_ms":0,"src_addr":"10.1.0.5:40002","src_workload":"web","src_pod":"web-1","src_namespace":"shop","src_principal":"","dst_addr":"10.1.0.9:8081","dst_workload":"db","dst_pod":"db-0","dst_namespace":"data","dst_principal":"","dst_service":"","bytes_to_dst":0,"bytes_to_src":0,"path":"plaintext","security":"none","policy_decision":"deny","policy":"data/deny-8081","policy_reason":"denied_by_policy","policy_dry_run":"","reason":"denied","limit":"","response_flags":"DENY","error":"denied by data/deny-8081"}`,
	`{"type":"closed","reporter":"source","start_time":"2026-11-30T10:00:03Z","end_time":"2026-11-30T10:00:03Z","duration_ms":0,"src_addr":"10.1.0.5:40003","src_workload":"web","src_pod":"web-1","src_namespace":"shop","src_principal":"","dst_addr":"93.184.216.34:443","dst_workload":"","dst_pod":"","dst_namespace":"","dst_principal":"","dst_service":"","bytes_to_dst":0,"bytes_to_src":0,"path":"passthrough","security":"none","policy_decision":"none","policy":"","policy_reason":"","policy_dry_run":"","reason":"limit","limit":"pod_connections","response_flags":"UO","error":"pod_connections limit"}`,
}

// serveFlows answers one client on a unix socket as aether-proxy's flows
// socket does: it reads the request line (sent on got), writes lines, then
// keeps the connection open until the client leaves, or closes it at once
// when hangUp is set.
func serveFlows(t *testing.T, hangUp bool, lines ...string) (string, <-chan string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "flows.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		in := bufio.NewReader(c)
		req, err := in.ReadString('\n')
		if err != nil {
			return
		}
		got <- strings.TrimSpace(req)
		for _, l := range lines {
			if _, err := io.WriteString(c, l+"\n"); err != nil {
				return
			}
		}
		if !hangUp {
			_, _ = io.Copy(io.Discard, in)
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return sock, got
}

// TestRunFlows renders the events as a table (golden text) and as JSON
// (the lines as the proxy sent them), sends the filters as the request,
// and stops after --count events (drop notices do not count).
func TestRunFlows(t *testing.T) {
	for _, tc := range []struct {
		name, golden string
		args         []string
		wantReq      string
	}{
		{"table", "flows-table.golden", []string{"--count", "4"}, `{}`},
		{
			"json with every filter", "",
			[]string{"-o", "json", "--count", "4", "--pod", "shop/web-1", "--namespace", "data", "--denied", "--service", "data/db", "--reporter", "source"},
			`{"pod":"shop/web-1","namespace":"data","denied":true,"service":"data/db","reporter":"source"}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock, got := serveFlows(t, false, flowLines...)
			var out bytes.Buffer
			if err := RunFlows(context.Background(), append(tc.args, "--socket", sock), &out); err != nil {
				t.Fatal(err)
			}
			if req := <-got; req != tc.wantReq {
				t.Errorf("request %s, want %s", req, tc.wantReq)
			}
			want := []byte(strings.Join(flowLines[1:], "\n") + "\n")
			if tc.golden != "" {
				golden := filepath.Join("testdata", tc.golden)
				if *update {
					if err := os.WriteFile(golden, out.Bytes(), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				var err error
				if want, err = os.ReadFile(golden); err != nil {
					t.Fatal(err)
				}
			}
			if out.String() != string(want) {
				t.Errorf("output:\n%s\nwant:\n%s", out.String(), want)
			}
		})
	}
}

// TestRunFlowsEnds: an interrupt (ctx) is a normal end; the proxy
// closing the stream is an error that says so.
func TestRunFlowsEnds(t *testing.T) {
	sock, _ := serveFlows(t, false, flowLines[:2]...)
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncWriter{line: make(chan struct{}, 8)}
	errc := make(chan error, 1)
	go func() { errc <- RunFlows(ctx, []string{"--socket", sock}, out) }()
	<-out.line // the header
	<-out.line // the open
	cancel()
	if err := <-errc; err != nil {
		t.Errorf("interrupted: %v, want nil", err)
	}
	sock, _ = serveFlows(t, true, flowLines[:2]...)
	err := RunFlows(context.Background(), []string{"--socket", sock}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "aether-proxy closed the flows stream") {
		t.Errorf("stream closed by the proxy: %v", err)
	}
}

// syncWriter signals each write (a line: RunFlows writes one at a time).
type syncWriter struct{ line chan struct{} }

func (w *syncWriter) Write(p []byte) (int, error) {
	w.line <- struct{}{}
	return len(p), nil
}

func TestRunFlowsFlagErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "flows.sock")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-o", "yaml"}, `invalid -o "yaml": want table or json`},
		{[]string{"--pod", "web-1"}, `invalid pod "web-1": want <namespace>/<name>`},
		{[]string{"--reporter", "client"}, `invalid reporter "client": want source or destination`},
		{[]string{"--service", "data/"}, `invalid service "data/"`},
		{[]string{"--count", "-1"}, `invalid --count -1`},
		{[]string{"web-1"}, `unexpected arguments ["web-1"]: aetherctl flows takes flags only`},
		{[]string{"--socket", missing}, `no flows socket at "` + missing + `"`},
		{[]string{"--socket", missing}, "-flows-socket"},
	} {
		err := RunFlows(context.Background(), tc.args, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("aetherctl flows %q: %v, want %q", tc.args, err, tc.want)
		}
	}
	sock, _ := serveFlows(t, true, `{"type":"error","detail":"permission denied: peer uid 1000 may not follow flows (allowed uids: [0])"}`)
	err := RunFlows(context.Background(), []string{"--socket", sock}, io.Discard)
	if err == nil || err.Error() != "aether-proxy refused the subscription: permission denied: peer uid 1000 may not follow flows (allowed uids: [0])" {
		t.Errorf("refused: %v", err)
	}
}
