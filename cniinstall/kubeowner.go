package cniinstall

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// ServiceAccountDir is where the kubelet mounts the pod's service account
// token and the cluster CA.
const ServiceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// KubeOwner answers OwnerChecker with two GETs on the API server: the
// installer's pod (for its controlling DaemonSet) and that DaemonSet. It is
// plain net/http and encoding/json: client-go would add about 22 MB to a
// 4.7 MB binary for two requests.
type KubeOwner struct {
	// BaseURL is the API server, for example https://10.96.0.1:443.
	BaseURL string
	// Namespace and Pod name the installer's pod.
	Namespace, Pod string
	// Token returns the bearer token; it is called per request, so a
	// rotated (projected) token is picked up.
	Token func() (string, error)
	// Client sends the requests (TLS to the API server configured).
	Client *http.Client
}

// InClusterOwner builds a KubeOwner from the pod's environment
// (KUBERNETES_SERVICE_HOST/PORT, POD_NAME, POD_NAMESPACE) and the service
// account files under saDir. It returns nil, nil outside a pod
// (KUBERNETES_SERVICE_HOST unset): there is no DaemonSet to ask about.
func InClusterOwner(getenv func(string) string, saDir string) (*KubeOwner, error) {
	host, port := getenv("KUBERNETES_SERVICE_HOST"), getenv("KUBERNETES_SERVICE_PORT")
	if host == "" {
		return nil, nil
	}
	if port == "" {
		port = "443"
	}
	ns, pod := getenv("POD_NAMESPACE"), getenv("POD_NAME")
	if ns == "" || pod == "" {
		return nil, fmt.Errorf("invalid environment for --uninstall-on-exit=auto: POD_NAME=%q and POD_NAMESPACE=%q must both be set "+
			"(downward API fieldRef metadata.name and metadata.namespace), or pass --uninstall-on-exit=always or never", pod, ns)
	}
	caFile := filepath.Join(saDir, "ca.crt")
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("failed to read cluster CA %q: %w", caFile, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("failed to parse cluster CA %q: no PEM certificate", caFile)
	}
	tokenFile := filepath.Join(saDir, "token")
	return &KubeOwner{
		BaseURL: "https://" + net.JoinHostPort(host, port), Namespace: ns, Pod: pod,
		Token: func() (string, error) {
			b, err := os.ReadFile(tokenFile)
			if err != nil {
				return "", fmt.Errorf("failed to read service account token %q: %w", tokenFile, err)
			}
			return strings.TrimSpace(string(b)), nil
		},
		Client: &http.Client{Transport: &http.Transport{
			TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
			Proxy:           nil, // in-cluster: never through a proxy
		}},
	}, nil
}

type ownerRef struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Name       string `json:"name"`
	Controller *bool  `json:"controller"`
}

type objectMeta struct {
	Metadata struct {
		OwnerReferences   []ownerRef `json:"ownerReferences"`
		DeletionTimestamp *time.Time `json:"deletionTimestamp"`
	} `json:"metadata"`
}

// errNotFound is a 404 from the API server.
var errNotFound = errors.New("not found")

// errRevoked is a 401 or 403: the installer's service account or its Role
// is gone. `helm uninstall` deletes them together with the DaemonSet, and
// the pods are stopped after that, so this is the answer an uninstalling
// installer gets most of the time.
var errRevoked = errors.New("access revoked")

// DaemonSetStays implements OwnerChecker.
func (k *KubeOwner) DaemonSetStays(ctx context.Context) (bool, string, error) {
	var pod objectMeta
	podPath := "/api/v1/namespaces/" + url.PathEscape(k.Namespace) + "/pods/" + url.PathEscape(k.Pod)
	err := k.get(ctx, podPath, &pod)
	if errors.Is(err, errRevoked) {
		return false, fmt.Sprintf("the API server refuses the installer's service account (%v): "+
			"its ServiceAccount or Role was deleted, as an uninstall does", err), nil
	}
	if err != nil {
		// The pod object outlives its graceful termination; a pod that is
		// gone was force-deleted: no answer.
		return false, "", fmt.Errorf("failed to get installer pod %q: %w", k.Namespace+"/"+k.Pod, err)
	}
	var ds *ownerRef
	for _, r := range pod.Metadata.OwnerReferences {
		if r.Controller != nil && *r.Controller && r.Kind == "DaemonSet" && strings.HasPrefix(r.APIVersion, "apps/") {
			ds = &r
			break
		}
	}
	if ds == nil {
		return false, fmt.Sprintf("pod %s/%s is not controlled by a DaemonSet", k.Namespace, k.Pod), nil
	}
	name := k.Namespace + "/" + ds.Name
	var obj objectMeta
	err = k.get(ctx, "/apis/apps/v1/namespaces/"+url.PathEscape(k.Namespace)+"/daemonsets/"+url.PathEscape(ds.Name), &obj)
	switch {
	case errors.Is(err, errNotFound):
		return false, fmt.Sprintf("DaemonSet %s is gone", name), nil
	case errors.Is(err, errRevoked):
		return false, fmt.Sprintf("the API server refuses to show DaemonSet %s (%v): its Role was deleted, as an uninstall does", name, err), nil
	case err != nil:
		return false, "", fmt.Errorf("failed to get DaemonSet %q: %w", name, err)
	case obj.Metadata.DeletionTimestamp != nil:
		return false, fmt.Sprintf("DaemonSet %s is being deleted (since %s)", name, obj.Metadata.DeletionTimestamp.Format(time.RFC3339)), nil
	}
	return true, fmt.Sprintf("DaemonSet %s exists and is not being deleted", name), nil
}

// get GETs path into out; a 404 is errNotFound, a 401 or 403 errRevoked,
// any other non-200 an error naming the status.
func (k *KubeOwner) get(ctx context.Context, path string, out any) error {
	token, err := k.Token()
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.BaseURL+path, nil)
	if err != nil {
		return fmt.Errorf("failed to build request %q: %w", path, err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "application/json")
	resp, err := k.Client.Do(req)
	if err != nil {
		return fmt.Errorf("failed to reach the API server: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("failed to read %q: %w", path, err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		return errNotFound
	case http.StatusUnauthorized, http.StatusForbidden:
		return fmt.Errorf("%w: GET %s answered %s", errRevoked, path, resp.Status)
	default:
		msg := body
		var st struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(body, &st) == nil && st.Message != "" {
			msg = []byte(st.Message)
		}
		return fmt.Errorf("GET %s answered %s: %.200s", path, resp.Status, msg)
	}
	if err := json.Unmarshal(body, out); err != nil {
		return fmt.Errorf("failed to decode %q: %w", path, err)
	}
	return nil
}
