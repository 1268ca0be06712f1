package cniinstall

import (
	"context"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const (
	dsOwnedPod = `{"metadata":{"ownerReferences":[
		{"apiVersion":"v1","kind":"Node","name":"n1","controller":false},
		{"apiVersion":"apps/v1","kind":"DaemonSet","name":"aether-node","controller":true}]}}`
	rsOwnedPod = `{"metadata":{"ownerReferences":[{"apiVersion":"apps/v1","kind":"ReplicaSet","name":"x-1","controller":true}]}}`
)

// TestKubeOwner: the two GETs and every answer, against a fake API server
// (the real one: TestKubeOwnerAPIServer).
func TestKubeOwner(t *testing.T) {
	for _, tc := range []struct {
		name      string
		pod, ds   string // JSON bodies; "" = 404
		status    int    // forced status of every answer (0 = 200/404)
		wantStays bool
		wantWhy   string
		wantErr   string
	}{
		{name: "DaemonSet stays", pod: dsOwnedPod, ds: `{"metadata":{}}`, wantStays: true, wantWhy: "DaemonSet aether-system/aether-node exists and is not being deleted"},
		{name: "DaemonSet gone", pod: dsOwnedPod, wantWhy: "DaemonSet aether-system/aether-node is gone"},
		{
			name: "DaemonSet being deleted", pod: dsOwnedPod, ds: `{"metadata":{"deletionTimestamp":"2026-11-30T18:00:00Z"}}`,
			wantWhy: "DaemonSet aether-system/aether-node is being deleted (since 2026-11-30T18:00:00Z)",
		},
		{name: "pod not controlled by a DaemonSet", pod: rsOwnedPod, wantWhy: "pod aether-system/install-x is not controlled by a DaemonSet"},
		{name: "pod gone: no answer", wantErr: `failed to get installer pod "aether-system/install-x": not found`},
		{
			name: "forbidden: revoked, uninstall", status: http.StatusForbidden,
			wantWhy: "the API server refuses the installer's service account (access revoked: GET /api/v1/namespaces/aether-system/pods/install-x answered 403 Forbidden): " +
				"its ServiceAccount or Role was deleted, as an uninstall does",
		},
		{
			name: "unauthorized: revoked, uninstall", status: http.StatusUnauthorized,
			wantWhy: "the API server refuses the installer's service account (access revoked: GET /api/v1/namespaces/aether-system/pods/install-x answered 401 Unauthorized): " +
				"its ServiceAccount or Role was deleted, as an uninstall does",
		},
		{name: "server error: no answer", status: http.StatusInternalServerError, wantErr: `answered 500 Internal Server Error: pods "install-x" is forbidden`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("Authorization") != "Bearer tok" {
					http.Error(w, "no token", http.StatusUnauthorized)
					return
				}
				if tc.status != 0 {
					w.WriteHeader(tc.status)
					_, _ = w.Write([]byte(`{"kind":"Status","message":"pods \"install-x\" is forbidden"}`))
					return
				}
				body := map[string]string{
					"/api/v1/namespaces/aether-system/pods/install-x":               tc.pod,
					"/apis/apps/v1/namespaces/aether-system/daemonsets/aether-node": tc.ds,
				}[r.URL.Path]
				if body == "" {
					http.NotFound(w, r)
					return
				}
				_, _ = w.Write([]byte(body))
			}))
			t.Cleanup(srv.Close)
			k := &KubeOwner{
				BaseURL: srv.URL, Namespace: "aether-system", Pod: "install-x", Client: srv.Client(),
				Token: func() (string, error) { return "tok", nil },
			}
			stays, why, err := k.DaemonSetStays(context.Background())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || stays != tc.wantStays || why != tc.wantWhy {
				t.Fatalf("DaemonSetStays = %v, %q, %v; want %v, %q", stays, why, err, tc.wantStays, tc.wantWhy)
			}
		})
	}
}

func TestInClusterOwner(t *testing.T) {
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	saDir := t.TempDir()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(filepath.Join(saDir, "ca.crt"), ca, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(saDir, "token"), []byte("tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	inPod := map[string]string{
		"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443",
		"POD_NAME": "install-x", "POD_NAMESPACE": "aether-system",
	}
	env := func(drop string) func(string) string {
		return func(k string) string {
			if k == drop {
				return ""
			}
			return inPod[k]
		}
	}
	for _, tc := range []struct {
		name, drop, saDir, wantErr string
		wantNil                    bool
	}{
		{name: "in a pod", saDir: saDir},
		{name: "outside a pod", drop: "KUBERNETES_SERVICE_HOST", saDir: saDir, wantNil: true},
		{name: "no POD_NAME", drop: "POD_NAME", saDir: saDir, wantErr: `POD_NAME="" and POD_NAMESPACE="aether-system" must both be set`},
		{name: "no POD_NAMESPACE", drop: "POD_NAMESPACE", saDir: saDir, wantErr: `POD_NAME="install-x" and POD_NAMESPACE="" must both be set`},
		{name: "no CA", saDir: t.TempDir(), wantErr: "failed to read cluster CA"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, err := InClusterOwner(env(tc.drop), tc.saDir)
			switch {
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
			case err != nil:
				t.Fatal(err)
			case tc.wantNil:
				if k != nil {
					t.Fatalf("owner %+v outside a pod, want nil", k)
				}
			default:
				if k.BaseURL != "https://[fd00::1]:6443" || k.Namespace != "aether-system" || k.Pod != "install-x" {
					t.Fatalf("owner = %+v", k)
				}
				if tok, err := k.Token(); err != nil || tok != "tok" {
					t.Fatalf("token = %q, %v", tok, err)
				}
				// The CA from ca.crt verifies the server.
				k.BaseURL = srv.URL
				if _, _, err := k.DaemonSetStays(context.Background()); err == nil || !strings.Contains(err.Error(), "not found") {
					t.Fatalf("request with the in-cluster TLS config: %v, want a 404 from the server", err)
				}
			}
		})
	}
}
