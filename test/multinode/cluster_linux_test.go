package multinode

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"aether.io/node/test/harness"
)

// Environment of a re-executed test binary in etcd member mode.
const (
	envMember  = "AETHER_MULTINODE_MEMBER"
	envDir     = "AETHER_MULTINODE_DIR"
	envIP      = "AETHER_MULTINODE_IP"
	envCluster = "AETHER_MULTINODE_CLUSTER"
)

const (
	clientPort = 2379
	peerPort   = 2380
	fabricIP   = "192.0.2.1"
	bridgeName = "br0"
)

func TestMain(m *testing.M) {
	if name := os.Getenv(envMember); name != "" {
		os.Exit(runMember(name))
	}
	harness.Main(m)
}

// runMember runs one etcd member until it is signalled.
func runMember(name string) int {
	ip := os.Getenv(envIP)
	cfg := embed.NewConfig()
	cfg.Name = name
	cfg.Dir = os.Getenv(envDir)
	cfg.Logger = "zap"
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{filepath.Join(cfg.Dir, "..", name+".log")}
	client := url.URL{Scheme: "http", Host: net.JoinHostPort(ip, fmt.Sprint(clientPort))}
	peer := url.URL{Scheme: "http", Host: net.JoinHostPort(ip, fmt.Sprint(peerPort))}
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = os.Getenv(envCluster)
	cfg.InitialClusterToken = "aether-multinode"
	// Short raft timings so elections after a fault take well under a second.
	cfg.TickMs = 50
	cfg.ElectionMs = 500
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "failed to start etcd member %q: %v\n", name, err)
		return 1
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-sig:
	case err := <-e.Err():
		fmt.Fprintf(os.Stderr, "etcd member %q failed: %v\n", name, err)
		e.Close()
		return 1
	}
	e.Close()
	return 0
}

// member is one etcd member process in its own namespace.
type member struct {
	name string
	ip   string
	ns   *harness.NS
	dir  string
	env  []string
	cmd  *exec.Cmd
	done chan struct{}
}

// endpoint is the member's client URL.
func (m *member) endpoint() string {
	return "http://" + net.JoinHostPort(m.ip, fmt.Sprint(clientPort))
}

// cluster is a three-member etcd cluster on a bridge in a fabric namespace.
type cluster struct {
	t       *testing.T
	fabric  *harness.NS
	members []*member
	client  *clientv3.Client
}

// newCluster starts the members and a client that dials from the fabric
// namespace; t.Cleanup stops all of it.
func newCluster(t *testing.T, n int) *cluster {
	t.Helper()
	harness.RequireRoot(t)
	c := &cluster{t: t, fabric: harness.NewNS(t, "fab")}
	harness.Bridge(t, c.fabric, bridgeName)
	harness.AddAddr(t, c.fabric, bridgeName, fabricIP+"/24")
	var initial []string
	for i := range n {
		m := &member{
			name: fmt.Sprintf("m%d", i),
			ip:   fmt.Sprintf("192.0.2.%d", 10+i),
			ns:   harness.NewNS(t, "etc"),
			dir:  filepath.Join(t.TempDir(), "data"),
		}
		harness.Veth(t, c.fabric, fmt.Sprintf("vm%d", i), m.ns, "eth0")
		harness.Enslave(t, c.fabric, fmt.Sprintf("vm%d", i), bridgeName)
		harness.AddAddr(t, m.ns, "eth0", m.ip+"/24")
		initial = append(initial, fmt.Sprintf("%s=http://%s", m.name, net.JoinHostPort(m.ip, fmt.Sprint(peerPort))))
		c.members = append(c.members, m)
	}
	for _, m := range c.members {
		m.env = append(os.Environ(),
			envMember+"="+m.name, envDir+"="+m.dir, envIP+"="+m.ip,
			envCluster+"="+strings.Join(initial, ","))
		c.start(m)
	}
	t.Cleanup(func() {
		for _, m := range c.members {
			c.stop(m, syscall.SIGTERM)
		}
	})
	c.client = c.newClient(nil)
	c.waitHealthy(30 * time.Second)
	return c
}

// newClient returns a client of every member but except (a partitioned
// member's blackholed connection would otherwise hold requests until their
// deadline); t.Cleanup closes it.
func (c *cluster) newClient(except *member) *clientv3.Client {
	c.t.Helper()
	var eps []string
	for _, m := range c.members {
		if m != except {
			eps = append(eps, m.endpoint())
		}
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   eps,
		DialTimeout: 2 * time.Second,
		// Retries against a killed or partitioned member are expected here.
		Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{
			grpc.WithContextDialer(c.dial),
			// Reconnect within a second of a member's restart: the test
			// polls for recovery and should see it when it happens.
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}, MinConnectTimeout: time.Second}),
		},
	})
	if err != nil {
		c.t.Fatalf("failed to create etcd client: %v", err)
	}
	c.t.Cleanup(func() { _ = cli.Close() })
	return cli
}

// dial opens a TCP connection from the fabric namespace; the socket keeps
// its namespace after the thread leaves it.
func (c *cluster) dial(ctx context.Context, addr string) (net.Conn, error) {
	var conn net.Conn
	err := c.fabric.Do(func() error {
		var err error
		conn, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		return err
	})
	return conn, err
}

// start starts m's process inside its namespace.
func (c *cluster) start(m *member) {
	c.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = m.env
	cmd.Stderr = os.Stderr
	// exec from the locked thread inside m.ns: the child inherits the namespace.
	m.ns.MustDo(c.t, cmd.Start)
	m.cmd = cmd
	m.done = make(chan struct{})
	done := m.done
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
}

// stop signals m's process and waits for it to exit.
func (c *cluster) stop(m *member, sig syscall.Signal) {
	if m.cmd == nil {
		return
	}
	stopProcess(m.cmd, m.done, sig, 10*time.Second)
	m.cmd = nil
}

// stopProcess signals cmd's process and waits until done closes (its Wait
// returned), killing it after grace.
func stopProcess(cmd *exec.Cmd, done <-chan struct{}, sig syscall.Signal, grace time.Duration) {
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(grace):
		_ = cmd.Process.Kill()
		<-done
	}
}

// put writes key=val with a bounded context.
func (c *cluster) put(key, val string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := c.client.Put(ctx, key, val)
	return err
}

// status returns the member's status, asked of that member alone.
func (c *cluster) status(m *member) (*clientv3.StatusResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return c.client.Status(ctx, m.endpoint())
}

// leader returns the member that the running members agree is leader.
func (c *cluster) leader(timeout time.Duration) *member {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		for _, m := range c.members {
			if m.cmd == nil {
				continue
			}
			st, err := c.status(m)
			if err != nil || st.Leader == 0 {
				continue
			}
			if st.Leader == st.Header.MemberId {
				return m
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.t.Fatalf("no etcd leader within %v", timeout)
	return nil
}

// waitHealthy waits until every running member answers Status with a leader
// and a linearizable write succeeds.
func (c *cluster) waitHealthy(timeout time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok := c.put("/health", time.Now().String()) == nil
		for _, m := range c.members {
			if m.cmd == nil {
				continue
			}
			if st, err := c.status(m); err != nil || st.Leader == 0 {
				ok = false
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("etcd cluster not healthy within %v", timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// nft runs an nft script inside m's namespace.
func (c *cluster) nft(m *member, script string) {
	c.t.Helper()
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out []byte
	m.ns.MustDo(c.t, func() error {
		var err error
		out, err = cmd.CombinedOutput()
		return err
	})
	if len(out) > 0 {
		c.t.Logf("nft: %s", out)
	}
}

// partition drops every packet in and out of m's eth0 (one nftables table in
// m's namespace; it dies with the namespace).
func (c *cluster) partition(m *member) {
	c.nft(m, `table inet aetpart {
  chain in { type filter hook input priority 0; policy accept; iifname "eth0" drop; }
  chain out { type filter hook output priority 0; policy accept; oifname "eth0" drop; }
}
`)
}

// heal removes m's partition.
func (c *cluster) heal(m *member) { c.nft(m, "delete table inet aetpart\n") }
