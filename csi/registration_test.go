package csi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// logRecords decodes the JSON log lines in the file at path.
func logRecords(t *testing.T, path string) []map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var recs []map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	for dec.More() {
		var r map[string]any
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("log does not decode: %v\n%s", err, b)
		}
		recs = append(recs, r)
	}
	return recs
}

// callTimeout bounds a broken server; it is no speed goal.
const callTimeout = 10 * time.Second

// TestRegistrationOverUnixSocket plays kubelet's plugin watcher against the
// registration socket: GetInfo announces a CSI plugin csi.aether.io at the
// kubelet-side endpoint with CSI v1; both verdicts of
// NotifyRegistrationStatus are logged (a refusal at error) and the service
// keeps answering after a refusal; the socket goes when Serve returns.
func TestRegistrationOverUnixSocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "plugins_registry", RegistrationSocket)
	const endpoint = "/var/lib/kubelet/plugins/csi.aether.io/csi.sock"
	// The server logs to a file (safe for its goroutines); read between calls.
	logPath := filepath.Join(dir, "log.json")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = logFile.Close() })
	reg := NewRegistration(endpoint, slog.New(slog.NewJSONHandler(logFile, &slog.HandlerOptions{Level: slog.LevelDebug})))
	l, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- reg.Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		<-served
	})

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := registerapi.NewRegistrationClient(conn)
	callCtx, callCancel := context.WithTimeout(context.Background(), callTimeout)
	defer callCancel()

	info, err := client.GetInfo(callCtx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.GetType() != registerapi.CSIPlugin || info.GetName() != "csi.aether.io" || info.GetEndpoint() != endpoint ||
		!slices.Equal(info.GetSupportedVersions(), []string{"1.0.0"}) {
		t.Errorf("GetInfo = %v, want type %s, name csi.aether.io, endpoint %s, versions [1.0.0]", info, registerapi.CSIPlugin, endpoint)
	}

	for _, tt := range []struct {
		status    *registerapi.RegistrationStatus
		wantLevel string
		wantMsg   string
		wantError string
	}{
		{&registerapi.RegistrationStatus{PluginRegistered: false, Error: "version 9.9 not supported"}, "ERROR", "kubelet refused the registration", "version 9.9 not supported"},
		{&registerapi.RegistrationStatus{PluginRegistered: true}, "INFO", "registered with kubelet", ""},
	} {
		if _, err := client.NotifyRegistrationStatus(callCtx, tt.status); err != nil {
			t.Fatalf("NotifyRegistrationStatus(%v): %v", tt.status, err)
		}
		var found bool
		for _, r := range logRecords(t, logPath) {
			if r["msg"] == tt.wantMsg {
				found = true
				if r["level"] != tt.wantLevel || r["endpoint"] != endpoint || r["driver"] != "csi.aether.io" {
					t.Errorf("log of %v = %v, want level %s naming driver and endpoint", tt.status, r, tt.wantLevel)
				}
				if got, _ := r["error"].(string); got != tt.wantError {
					t.Errorf("log of %v has error %q, want %q", tt.status, got, tt.wantError)
				}
			}
		}
		if !found {
			t.Errorf("NotifyRegistrationStatus(%v) logged no %q", tt.status, tt.wantMsg)
		}
	}
	// Still serving after the refusal above.
	if _, err := client.GetInfo(callCtx, &registerapi.InfoRequest{}); err != nil {
		t.Errorf("GetInfo after a refused registration: %v", err)
	}

	cancel()
	if err := <-served; err != nil {
		t.Errorf("Serve after cancel = %v, want nil", err)
	}
	served <- nil // for the cleanup
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("registration socket left after Serve returned: %v", err)
	}
}
