package kubetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"aether.io/node/pkg/filelock"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

// Versions pin what test/kube/go.mod requires.
const (
	KubernetesVersion = "v1.37.2"
	EtcdVersion       = "v3.7.3"
)

const token = "aether-test-token"

// BinDir returns the cache directory holding kube-apiserver and etcd,
// building whichever is missing (under a per-directory file lock, so
// parallel test processes build once).
func BinDir(tb testing.TB) string {
	tb.Helper()
	dir := filepath.Join(harness.CacheDir(), "kube", KubernetesVersion+"-etcd-"+EtcdVersion)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	unlock, err := lock(dir)
	if err != nil {
		tb.Fatal(err)
	}
	defer unlock()
	mod := filepath.Join(harness.ModuleRoot(), "test", "kube")
	builds := []struct{ name, pkg, ldflags string }{
		{"etcd", "./etcd", "-s -w"},
		{"kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver", "-s -w -X k8s.io/component-base/version.gitVersion=" + KubernetesVersion +
			" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37"},
	}
	for _, b := range builds {
		out := filepath.Join(dir, b.name)
		if _, err := os.Stat(out); err == nil {
			continue
		}
		tb.Logf("building %s into %s (cold builds of kube-apiserver take ~8-13 min on 2 cores)", b.name, dir)
		start := time.Now()
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", b.ldflags, "-o", out+".tmp", b.pkg)
		cmd.Dir = mod
		if o, err := cmd.CombinedOutput(); err != nil {
			tb.Fatalf("failed to build %s: %v\n%s", b.name, err, o)
		}
		if err := os.Rename(out+".tmp", out); err != nil {
			tb.Fatal(err)
		}
		tb.Logf("built %s in %s", b.name, time.Since(start).Round(time.Second))
	}
	return dir
}

func lock(dir string) (func(), error) {
	return filelock.Lock(filepath.Join(dir, ".lock"), 0o644)
}

func freePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Cluster is a running etcd + kube-apiserver.
type Cluster struct {
	// Kubeconfig is the path of a kubeconfig for the apiserver.
	Kubeconfig string
	// Client is a clientset with cluster-admin rights.
	Client kubernetes.Interface
	// Config is the rest config behind Client.
	Config *rest.Config

	mu   sync.Mutex
	cmds []*proc
}

type proc struct {
	name string
	cmd  *exec.Cmd
	out  *lockedBuf
	done chan struct{}
}

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func start(tb testing.TB, name string, args []string, dir string) *proc {
	tb.Helper()
	p := &proc{name: name, out: &lockedBuf{}, done: make(chan struct{})}
	p.cmd = exec.Command(args[0], args[1:]...)
	p.cmd.Dir = dir
	p.cmd.Stdout = p.out
	p.cmd.Stderr = p.out
	p.cmd.SysProcAttr = &unix.SysProcAttr{Pdeathsig: unix.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		tb.Fatalf("failed to start %s: %v", name, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	return p
}

func (p *proc) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Start runs etcd and kube-apiserver (building them if needed), waits for
// /readyz and the default namespace, and stops both in tb.Cleanup.
func Start(tb testing.TB) *Cluster {
	tb.Helper()
	bins := BinDir(tb)
	dir := tb.TempDir()
	etcdPort, peerPort, apiPort := freePort(tb), freePort(tb), freePort(tb)
	c := &Cluster{}
	tb.Cleanup(c.Stop)

	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	etcd := start(tb, "etcd", []string{
		filepath.Join(bins, "etcd"), "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-url", etcdURL, "--listen-peer-url", fmt.Sprintf("http://127.0.0.1:%d", peerPort),
	}, dir)
	c.add(etcd)
	waitFor(tb, "etcd ready", 60*time.Second, etcd, func() bool { return strings.Contains(etcd.out.String(), "READY") })

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		tb.Fatal(err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		tb.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			tb.Fatal(err)
		}
		return p
	}
	saKey := write("sa.key", pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	saPub := write("sa.pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}))
	tokens := write("tokens.csv", []byte(token+`,admin,admin-uid,"system:masters"`+"\n"))
	api := start(tb, "kube-apiserver", []string{
		filepath.Join(bins, "kube-apiserver"),
		"--etcd-servers=" + etcdURL, "--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saPub, "--service-account-signing-key-file=" + saKey,
		"--cert-dir=" + filepath.Join(dir, "certs"), fmt.Sprintf("--secure-port=%d", apiPort), "--bind-address=127.0.0.1",
		"--authorization-mode=RBAC", "--allow-privileged=true", "--token-auth-file=" + tokens, "--service-cluster-ip-range=10.96.0.0/16",
	}, dir)
	c.add(api)

	host := fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	c.Config = &rest.Config{Host: host, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{Insecure: true}}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: insecureTLS()}}
	waitFor(tb, "kube-apiserver /readyz", 120*time.Second, api, func() bool {
		req, _ := http.NewRequest("GET", host+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := hc.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		tb.Fatal(err)
	}
	waitFor(tb, "default namespace", 60*time.Second, api, func() bool {
		_, err := c.Client.CoreV1().Namespaces().Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil
	})
	c.Kubeconfig = write("kubeconfig", []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: %s
contexts:
- name: test
  context:
    cluster: test
    user: admin
current-context: test
`, host, token)))
	return c
}

func (c *Cluster) add(p *proc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cmds = append(c.cmds, p)
}

// Stop stops kube-apiserver and etcd (the API is then gone).
func (c *Cluster) Stop() {
	c.mu.Lock()
	cmds := c.cmds
	c.cmds = nil
	c.mu.Unlock()
	for i := len(cmds) - 1; i >= 0; i-- {
		cmds[i].stop()
	}
}

// Namespace creates namespace ns (if needed) and its ServiceAccount
// "default" (there is no controller-manager to create it).
func (c *Cluster) Namespace(tb testing.TB, ns string) {
	tb.Helper()
	ctx := context.Background()
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		tb.Fatalf("failed to create namespace %q: %v", ns, err)
	}
	if _, err := c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		tb.Fatalf("failed to create service account %s/default: %v", ns, err)
	}
}

func waitFor(tb testing.TB, what string, d time.Duration, p *proc, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		select {
		case <-p.done:
			tb.Fatalf("%s exited while waiting for %s:\n%s", p.name, what, tail(p.out.String()))
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s:\n%s", d, what, tail(p.out.String()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func tail(s string) string {
	if len(s) > 4000 {
		return s[len(s)-4000:]
	}
	return s
}
