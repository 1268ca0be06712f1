package app

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"aether.io/node/agent/identity/identitytest"
	"aether.io/node/csi"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/registry"
)

func TestParseFlags(t *testing.T) {
	c, err := ParseFlags([]string{"--allowed-uids", "0, 1000", "--system-namespaces", "a,b", "--locality", "r/z", "--node-name", "n1"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.AllowedUIDs) != 2 || c.AllowedUIDs[1] != 1000 || strings.Join(c.SystemNamespaces, ",") != "a,b" ||
		c.Locality != (registry.Locality{Region: "r", Zone: "z"}) || c.CNISocket != "/run/aether/agent/cni.sock" || c.NodeName != "n1" ||
		c.InboundPolicy != "permissive" || c.GCPercent != DefaultGCPercent {
		t.Fatalf("config = %+v", c)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--allowed-uids", "root"}, "invalid --allowed-uids entry \"root\""},
		{[]string{"--allowed-uids", ""}, "at least one uid"},
		{[]string{"--locality", "a/b/c/d"}, "invalid --locality"},
		{[]string{"--node-name", ""}, "invalid --node-name"},
		{[]string{"extra"}, "unexpected arguments"},
		{[]string{"--inbound-policy", "mtls"}, `invalid --inbound-policy "mtls": want permissive or strict`},
		{[]string{"--liveness-interval", "0s"}, "must be positive"},
		{[]string{"--gc-percent", "0"}, "invalid --gc-percent 0: want at least 1"},
		{[]string{"--registry=etcd", "--etcd-endpoints", "http://10.0.0.1:2379"}, `endpoint "http://10.0.0.1:2379" is http://`},
		{[]string{"--registry=etcd", "--etcd-endpoints", "http://10.0.0.1:2379"}, "pass --etcd-insecure"},
		{[]string{"--registry=etcd", "--etcd-endpoints", "https://10.0.0.1:2379"}, "pass --etcd-insecure"},
		{[]string{"--registry=etcd", "--etcd-endpoints", "https://10.0.0.1:2379,http://10.0.0.2:2379", "--etcd-ca", "/etc/ca.pem"}, `endpoint "http://10.0.0.2:2379" would drop TLS`},
		{[]string{"--registry=etcd", "--etcd-endpoints", "http://10.0.0.1:2379", "--etcd-ca", "/etc/ca.pem", "--etcd-insecure"}, "need https:// endpoints, even with --etcd-insecure"},
		{[]string{"--registry=kube", "--pod-manifests", "/etc/aether/pods"}, "invalid --registry=kube with --pod-manifests"},
		{[]string{"--registry=consul"}, `invalid --registry "consul": want local, kube or etcd`},
		{[]string{"--xds-address", ":15010"}, "beyond loopback workload discovery requires mutual TLS"},
		{[]string{"--xds-address", "10.0.0.5:15010"}, "requires mutual TLS"},
		{[]string{"--xds-address", "node.example:15010"}, "requires mutual TLS"},
		{[]string{"--xds-address", "10.0.0.5:15010", "--xds-tls-cert", "/c", "--xds-tls-key", "/k"}, "give all three or none"},
		{[]string{"--xds-tls-cert", "/c", "--xds-tls-key", "/k", "--xds-client-ca", "/ca"}, "given without --xds-address"},
		{[]string{"--xds-address", "15010"}, "want host:port"},
		{[]string{"--xds-address", "127.0.0.1:15010", "--xds-max-recv-bytes", "0"}, "invalid --xds-max-recv-bytes 0"},
	} {
		if _, err := ParseFlags(tc.args, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseFlags(%q) = %v, want %q", tc.args, err, tc.want)
		}
	}
	for _, args := range [][]string{
		{"--etcd-endpoints", "http://10.0.0.1:2379", "--etcd-insecure"},
		{"--etcd-endpoints", "unix:///run/etcd.sock", "--etcd-insecure"},
		{"--etcd-endpoints", "https://10.0.0.1:2379", "--etcd-ca", "/etc/ca.pem"},
	} {
		c, err := ParseFlags(append([]string{"--registry=etcd"}, args...), &bytes.Buffer{})
		if err != nil {
			t.Errorf("ParseFlags(%q) = %v", args, err)
			continue
		}
		if o := c.etcdOptions(); o.Insecure != slices.Contains(args, "--etcd-insecure") || o.CAFile != c.EtcdCAFile || len(o.Endpoints) != 1 {
			t.Errorf("ParseFlags(%q): etcd options %+v", args, o)
		}
	}
	for _, args := range [][]string{
		{"--xds-address", "127.0.0.1:15010"},
		{"--xds-address", "[::1]:15010"},
		{"--xds-address", "localhost:15010"},
		{"--xds-address", "10.0.0.5:15010", "--xds-tls-cert", "/c", "--xds-tls-key", "/k", "--xds-client-ca", "/ca"},
	} {
		if _, err := ParseFlags(args, &bytes.Buffer{}); err != nil {
			t.Errorf("ParseFlags(%q) = %v", args, err)
		}
	}
	var out bytes.Buffer
	if _, err := ParseFlags([]string{"--help"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "-pod-manifests") {
		t.Fatalf("--help = %v:\n%s", err, out.String())
	}
}

// TestUDSCSIRootAgreesWithTheDriver checks aether-agent and aether-csi read
// <uds-csi-root> from the same flag with the same default, and that one
// value passed to both gives both the same root.
func TestUDSCSIRootAgreesWithTheDriver(t *testing.T) {
	for _, args := range [][]string{nil, {"--" + meshcontract.UDSCSIRootFlag, "/srv/uds"}} {
		agent, err := ParseFlags(append([]string{"--node-name", "n1"}, args...), &bytes.Buffer{})
		if err != nil {
			t.Fatalf("agent ParseFlags(%q): %v", args, err)
		}
		driver, err := csi.ParseFlags(append([]string{"--node-name", "n1"}, args...), &bytes.Buffer{})
		if err != nil {
			t.Fatalf("aether-csi ParseFlags(%q): %v", args, err)
		}
		if agent.UDSRoot != driver.Root {
			t.Errorf("args %q: agent root %q, driver root %q", args, agent.UDSRoot, driver.Root)
		}
	}
	c, err := ParseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if c.UDSRoot != meshcontract.DefaultUDSCSIRoot {
		t.Errorf("agent default root %q, want %q", c.UDSRoot, meshcontract.DefaultUDSCSIRoot)
	}
}

// TestParseFlagsIdentity: the CA flags load and validate the CA up front,
// so a bad CA is a configuration error (aether-agent exits 2) naming the
// files and ParseCA's reason; without them identity is off.
func TestParseFlagsIdentity(t *testing.T) {
	dir := t.TempDir()
	good := identitytest.Valid("cluster.local")
	cert, key := identitytest.Files(t, mkdir(t, dir, "good"), good)
	expired := good
	expired.NotBefore, expired.NotAfter = time.Now().Add(-48*time.Hour), time.Now().Add(-24*time.Hour)
	oldCert, oldKey := identitytest.Files(t, mkdir(t, dir, "expired"), expired)
	otherCert, otherKey := identitytest.Files(t, mkdir(t, dir, "other"), identitytest.Valid("other.example"))
	base := []string{"--node-name", "n1"}

	c, err := ParseFlags(base, &bytes.Buffer{})
	if err != nil || c.CA != nil || c.SVIDTTL != 4*time.Hour || c.WorkloadAPISocket != ProxySocketDir+"/workload.sock" {
		t.Fatalf("defaults: %+v, %v; want identity off, 4h TTL, %s/workload.sock", c, err, ProxySocketDir)
	}
	c, err = ParseFlags(append(base, "--ca-cert", cert, "--ca-key", key, "--svid-ttl", "1h"), &bytes.Buffer{})
	if err != nil || c.CA == nil || c.SVIDTTL != time.Hour {
		t.Fatalf("good CA: %+v, %v", c, err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"cert without key", []string{"--ca-cert", cert}, "give both"},
		{"key without cert", []string{"--ca-key", key}, "give both"},
		{"missing file", []string{"--ca-cert", dir + "/nope.crt", "--ca-key", key}, `failed to read --ca-cert "` + dir + `/nope.crt"`},
		{"key of another CA", []string{"--ca-cert", cert, "--ca-key", otherKey}, "key does not match certificate"},
		{"expired", []string{"--ca-cert", oldCert, "--ca-key", oldKey}, "expired at"},
		{"other trust domain", []string{"--ca-cert", otherCert, "--ca-key", otherKey}, `trust domain "other.example", want "cluster.local"`},
		{"cert and key swapped", []string{"--ca-cert", key, "--ca-key", cert}, "no PEM CERTIFICATE block"},
		{"ttl too short", []string{"--ca-cert", cert, "--ca-key", key, "--svid-ttl", "1s"}, "invalid --svid-ttl 1s"},
		{"no socket", []string{"--ca-cert", cert, "--ca-key", key, "--workload-api-socket", ""}, "invalid --workload-api-socket"},
		{"bad trust domain", []string{"--ca-cert", cert, "--ca-key", key, "--trust-domain", "Bad Domain"}, `invalid --trust-domain "Bad Domain"`},
	} {
		if _, err := ParseFlags(append(base, tc.args...), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: ParseFlags = %v, want %q", tc.name, err, tc.want)
		}
	}
}

func mkdir(t *testing.T, parent, name string) string {
	t.Helper()
	d := filepath.Join(parent, name)
	if err := os.Mkdir(d, 0o700); err != nil {
		t.Fatal(err)
	}
	return d
}

// TestApplyGCPercent checks --gc-percent sets the GC target and that a
// GOGC environment variable wins over it.
func TestApplyGCPercent(t *testing.T) {
	prev := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(prev) })
	t.Setenv("GOGC", "")
	if err := os.Unsetenv("GOGC"); err != nil {
		t.Fatal(err)
	}
	if got := applyGCPercent(250); got != 250 || debug.SetGCPercent(250) != 250 {
		t.Fatalf("applyGCPercent(250) without GOGC = %d, runtime at %d", got, debug.SetGCPercent(250))
	}
	t.Setenv("GOGC", "150")
	debug.SetGCPercent(150) // what the runtime read from GOGC at start
	if got := applyGCPercent(400); got != 150 || debug.SetGCPercent(150) != 150 {
		t.Fatalf("applyGCPercent(400) with GOGC=150 = %d, want the runtime left at 150", got)
	}
}

// TestCgroupMemoryLimit reads the memory limit of the process's cgroup from
// cgroup v2 and v1 layouts, at the process's path or the mount's root, and
// treats "max", v1's huge "unlimited" and missing files as no limit.
func TestCgroupMemoryLimit(t *testing.T) {
	write := func(t *testing.T, root, rel, body string) {
		t.Helper()
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const v2self = "0::/kubepods/pod1/agent\n"
	const v1self = "12:pids:/x\n4:memory:/kubepods/pod1/agent\n1:name=systemd:/y\n"
	for _, tc := range []struct {
		name  string
		files map[string]string
		self  string
		want  int64
	}{
		{"v2 at the process's path", map[string]string{"kubepods/pod1/agent/memory.max": "268435456\n", "memory.max": "max\n"}, v2self, 256 << 20},
		{"v2 at the root (own cgroup namespace)", map[string]string{"memory.max": "134217728\n"}, "0::/\n", 128 << 20},
		{"v2 unlimited", map[string]string{"kubepods/pod1/agent/memory.max": "max\n"}, v2self, 0},
		{"v1 at the process's path", map[string]string{"memory/kubepods/pod1/agent/memory.limit_in_bytes": "536870912\n"}, v1self, 512 << 20},
		{"v1 unlimited", map[string]string{"memory/kubepods/pod1/agent/memory.limit_in_bytes": "9223372036854771712\n"}, v1self, 0},
		{"no file", nil, v2self, 0},
		{"garbage", map[string]string{"memory.max": "lots\n"}, "0::/\n", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for rel, body := range tc.files {
				write(t, root, rel, body)
			}
			if got := cgroupMemoryLimit(root, []byte(tc.self)); got != tc.want {
				t.Fatalf("cgroupMemoryLimit = %d, want %d", got, tc.want)
			}
		})
	}
}

// TestApplyMemoryLimit: with a cgroup limit the runtime's soft limit is set
// to memoryLimitShare of it; a GOMEMLIMIT environment variable wins.
func TestApplyMemoryLimit(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(prev) })
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "memory.max"), []byte("268435456\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("GOMEMLIMIT", "")
	if err := os.Unsetenv("GOMEMLIMIT"); err != nil {
		t.Fatal(err)
	}
	want := int64(float64(256<<20) * memoryLimitShare)
	if got := applyMemoryLimit(root, []byte("0::/\n")); got != want || debug.SetMemoryLimit(-1) != want {
		t.Fatalf("applyMemoryLimit = %d, runtime at %d; want %d", got, debug.SetMemoryLimit(-1), want)
	}
	debug.SetMemoryLimit(prev)
	t.Setenv("GOMEMLIMIT", "1GiB")
	if got := applyMemoryLimit(root, []byte("0::/\n")); got != 0 || debug.SetMemoryLimit(-1) != prev {
		t.Fatalf("applyMemoryLimit with GOMEMLIMIT set = %d, runtime at %d; want 0 and the runtime untouched", got, debug.SetMemoryLimit(-1))
	}
}

// TestSocketDefaultsByAudience: the sockets aether-proxy consumes default
// to ProxySocketDir, the ones it must never see (CNI, admin) to SocketDir,
// and the two directories differ.
func TestSocketDefaultsByAudience(t *testing.T) {
	c, err := ParseFlags([]string{"--node-name", "n1"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if SocketDir == ProxySocketDir {
		t.Fatalf("SocketDir and ProxySocketDir are both %q", SocketDir)
	}
	for flag, got := range map[string]string{"cni-socket": c.CNISocket, "admin-socket": c.AdminSocket} {
		if want := "/run/aether/agent/"; filepath.Dir(got)+"/" != want {
			t.Errorf("--%s default %q, want it in %s", flag, got, want)
		}
	}
	for flag, got := range map[string]string{"xds-socket": c.XDSSocket, "lds-socket": c.LDSSocket, "workload-api-socket": c.WorkloadAPISocket} {
		if want := "/run/aether/proxy/"; filepath.Dir(got)+"/" != want {
			t.Errorf("--%s default %q, want it in %s", flag, got, want)
		}
	}
}
