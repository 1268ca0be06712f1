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
	"slices"
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

// Binaries BinDir can build from test/kube: etcd and kube-apiserver are
// always built; the others only when asked for.
const (
	Etcd              = "etcd"
	APIServer         = "kube-apiserver"
	ControllerManager = "kube-controller-manager"
	Scheduler         = "kube-scheduler"
	Kubelet           = "kubelet"
	KubeProxy         = "kube-proxy"
)

// BinDir returns the cache directory holding etcd, kube-apiserver and the
// extra binaries named (ControllerManager, Scheduler, Kubelet), building
// whichever is missing (under a per-directory file lock, so parallel test
// processes build once). Builds run under nice so that they share the
// machine; each build's duration is logged.
func BinDir(tb testing.TB, extra ...string) string {
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
	k8s := "-s -w -X k8s.io/component-base/version.gitVersion=" + KubernetesVersion +
		" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37"
	builds := []struct{ name, pkg, ldflags string }{
		{Etcd, "./etcd", "-s -w"},
		{APIServer, "k8s.io/kubernetes/cmd/kube-apiserver", k8s},
	}
	for _, name := range extra {
		switch name {
		case Etcd, APIServer:
		case ControllerManager, Scheduler, Kubelet, KubeProxy:
			builds = append(builds, struct{ name, pkg, ldflags string }{name, "k8s.io/kubernetes/cmd/" + name, k8s})
		default:
			tb.Fatalf("unknown binary %q: BinDir builds %s, %s, %s, %s, %s and %s", name, Etcd, APIServer, ControllerManager, Scheduler, Kubelet, KubeProxy)
		}
	}
	for _, b := range builds {
		out := filepath.Join(dir, b.name)
		if _, err := os.Stat(out); err == nil {
			continue
		}
		tb.Logf("building %s into %s (cold builds: kube-apiserver ~8-13 min, kubelet several minutes on 2 cores)", b.name, dir)
		start := time.Now()
		cmd := exec.Command("nice", "-n", "10", "go", "build", "-trimpath", "-ldflags", b.ldflags, "-o", out+".tmp", b.pkg)
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

// FreePort returns a TCP port free on the machine's loopback now (so also
// free in a new network namespace).
func FreePort(tb testing.TB) int {
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
	// Kubeconfig is the path of a kubeconfig for the apiserver (admin).
	Kubeconfig string
	// Client is a clientset with cluster-admin rights.
	Client kubernetes.Interface
	// Config is the rest config behind Client (it dials through the
	// network namespace when the cluster runs in one).
	Config *rest.Config
	// Dir holds the cluster's files: etcd data, the service-account key
	// pair (sa.key, sa.pub), the apiserver's certificates (certs/), the
	// kubeconfig.
	Dir string
	// Port is kube-apiserver's secure port on 127.0.0.1.
	Port int

	ns   *harness.NS
	mu   sync.Mutex
	cmds []*Proc
	// apiArgs are kube-apiserver's command line, kept so StartAPIServer
	// runs it again with the same certs, port, etcd and flags.
	apiArgs []string
	// api is kube-apiserver's current process (also in cmds).
	api *Proc
	// health polls /readyz.
	health func() bool
}

// Proc is a process started by the cluster; Stop (and Cluster.Stop) end it.
type Proc struct {
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

func start(tb testing.TB, ns *harness.NS, name string, args []string, dir string) *Proc {
	tb.Helper()
	p := &Proc{name: name, out: &lockedBuf{}, done: make(chan struct{})}
	p.cmd = exec.Command(args[0], args[1:]...)
	p.cmd.Dir = dir
	p.cmd.Stdout = p.out
	p.cmd.Stderr = p.out
	p.cmd.SysProcAttr = &unix.SysProcAttr{Pdeathsig: unix.SIGKILL}
	run := p.cmd.Start
	if ns != nil {
		run = func() error { return ns.Do(p.cmd.Start) }
	}
	if err := run(); err != nil {
		tb.Fatalf("failed to start %s: %v", name, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	return p
}

// Stop sends SIGTERM to the process (by its PID) and waits for it, killing
// it after 10 s. It is idempotent.
func (p *Proc) Stop() { p.stop(10 * time.Second) }

// stop is Stop with grace as the time between SIGTERM and SIGKILL.
func (p *Proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Output returns the tail of the process's combined output.
func (p *Proc) Output() string { return tail(p.out.String()) }

// Exited is closed when the process has exited.
func (p *Proc) Exited() <-chan struct{} { return p.done }

// Options tune StartWith.
type Options struct {
	// NetNS runs etcd, kube-apiserver and every process started with Run
	// in this network namespace: the API listens on the namespace's
	// loopback only, and Config dials through the namespace. Nil means
	// the machine's loopback.
	NetNS *harness.NS
	// APIServerArgs are appended to kube-apiserver's flags.
	APIServerArgs []string
	// Binaries are the extra binaries BinDir builds (ControllerManager,
	// Scheduler, Kubelet).
	Binaries []string
}

// Start runs etcd and kube-apiserver (building them if needed), waits for
// /readyz and the default namespace, and stops both in tb.Cleanup.
func Start(tb testing.TB) *Cluster {
	tb.Helper()
	return StartWith(tb, Options{})
}

// StartWith is Start with options.
func StartWith(tb testing.TB, o Options) *Cluster {
	tb.Helper()
	bins := BinDir(tb, o.Binaries...)
	dir := tb.TempDir()
	etcdPort, peerPort, apiPort := FreePort(tb), FreePort(tb), FreePort(tb)
	c := &Cluster{Dir: dir, Port: apiPort, ns: o.NetNS}
	tb.Cleanup(c.Stop)

	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	etcd := start(tb, o.NetNS, "etcd", []string{
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
	c.apiArgs = append([]string{
		filepath.Join(bins, "kube-apiserver"),
		"--etcd-servers=" + etcdURL, "--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saPub, "--service-account-signing-key-file=" + saKey,
		"--cert-dir=" + filepath.Join(dir, "certs"), fmt.Sprintf("--secure-port=%d", apiPort), "--bind-address=127.0.0.1",
		"--authorization-mode=RBAC", "--allow-privileged=true", "--token-auth-file=" + tokens, "--service-cluster-ip-range=10.96.0.0/16",
	}, o.APIServerArgs...)
	api := start(tb, o.NetNS, "kube-apiserver", c.apiArgs, dir)
	c.add(api)
	c.api = api

	host := fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	c.Config = &rest.Config{Host: host, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{Insecure: true}}
	tr := &http.Transport{TLSClientConfig: insecureTLS()}
	if o.NetNS != nil {
		c.Config.Dial = c.dial
		tr.DialContext = c.dial
	}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: tr}
	c.health = func() bool {
		req, _ := http.NewRequest("GET", host+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := hc.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	}
	waitFor(tb, "kube-apiserver /readyz", 120*time.Second, api, c.health)
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

// dial opens a connection from inside the cluster's network namespace.
func (c *Cluster) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	err := c.ns.Do(func() error {
		var err error
		conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return conn, err
}

// Dial opens a connection to addr from where the cluster runs (inside
// Options.NetNS when set): for a test to reach what runs next to the
// apiserver, such as a hostNetwork pod's port.
func (c *Cluster) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	if c.ns == nil {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	return c.dial(ctx, network, addr)
}

// Run starts another process next to the apiserver (in Options.NetNS when
// set), with dir as its working directory; Cluster.Stop stops it before
// kube-apiserver and etcd, in the reverse order of starting. A test that
// must stop it earlier calls Proc.Stop (idempotent).
func (c *Cluster) Run(tb testing.TB, dir string, args ...string) *Proc {
	tb.Helper()
	p := start(tb, c.ns, filepath.Base(args[0]), args, dir)
	c.add(p)
	return p
}

// RunIn is Run in the network namespace ns instead of the cluster's: a
// process of another node (its kubelet, its kube-proxy) that Cluster.Stop
// stops like the others.
func (c *Cluster) RunIn(tb testing.TB, ns *harness.NS, dir string, args ...string) *Proc {
	tb.Helper()
	p := start(tb, ns, filepath.Base(args[0]), args, dir)
	c.add(p)
	return p
}

// WaitFor polls cond every 50 ms until it holds, failing the test after d
// or when p exits first (with p's output).
func WaitFor(tb testing.TB, what string, d time.Duration, p *Proc, cond func() bool) {
	tb.Helper()
	waitFor(tb, what, d, p, cond)
}

func (c *Cluster) add(p *Proc) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cmds = append(c.cmds, p)
}

// Stop stops every process Run started (newest first), then kube-apiserver,
// then etcd (the apiserver hangs on SIGTERM when etcd is gone first).
func (c *Cluster) Stop() {
	c.mu.Lock()
	cmds := c.cmds
	c.cmds = nil
	c.mu.Unlock()
	for i := len(cmds) - 1; i >= 0; i-- {
		cmds[i].Stop()
	}
}

// StopAPIServer stops kube-apiserver (SIGTERM by its PID, SIGKILL after
// apiStopGrace: with a kubelet's watches open it does not finish its
// graceful shutdown within 10 s, and what tests need is an API server that
// is gone, not its drain) and leaves etcd and every process Run started running: clients,
// kubelet and the pods' agents see a refused connection until
// StartAPIServer. If tb ends with the API server still down, tb.Cleanup
// starts it again, so the steps after a failed one still have it.
func (c *Cluster) StopAPIServer(tb testing.TB) {
	tb.Helper()
	api := c.apiServer(tb)
	api.stop(apiStopGrace)
	tb.Cleanup(func() {
		c.mu.Lock()
		down := c.api == api
		c.mu.Unlock()
		if down {
			tb.Logf("restarting kube-apiserver (the test ended while it was down)")
			c.StartAPIServer(tb)
		}
	})
}

// StartAPIServer starts kube-apiserver again after StopAPIServer, with
// the same command line: the same certificates (its --cert-dir keeps the
// self-signed pair it wrote), secure port, etcd data, service-account
// keys and flags, so clients holding the Cluster's Config or Kubeconfig
// reconnect without a change. It waits for /readyz (up to 120 s) and
// returns how long that took. Cluster.Stop stops it in the old one's
// place (before etcd).
func (c *Cluster) StartAPIServer(tb testing.TB) time.Duration {
	tb.Helper()
	old := c.apiServer(tb)
	select {
	case <-old.done:
	default:
		tb.Fatal("kube-apiserver is still running: StopAPIServer first")
	}
	begin := time.Now()
	api := start(tb, c.ns, "kube-apiserver", c.apiArgs, c.Dir)
	c.mu.Lock()
	c.api = api
	if i := slices.Index(c.cmds, old); i >= 0 {
		c.cmds[i] = api
	} else {
		c.cmds = append(c.cmds, api)
	}
	c.mu.Unlock()
	waitFor(tb, "restarted kube-apiserver /readyz", 120*time.Second, api, c.health)
	return time.Since(begin)
}

// apiStopGrace is how long StopAPIServer waits after SIGTERM.
const apiStopGrace = 2 * time.Second

// apiServer is kube-apiserver's current process.
func (c *Cluster) apiServer(tb testing.TB) *Proc {
	tb.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.api == nil {
		tb.Fatal("kube-apiserver was never started")
	}
	return c.api
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

func waitFor(tb testing.TB, what string, d time.Duration, p *Proc, cond func() bool) {
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
