// Package etcdtest runs a real single-member etcd (go.etcd.io/etcd/server/v3
// embed) on loopback ports with its data in a test's temp dir, for tests of
// the etcd registry and of what follows it. It can be stopped and started
// again on the same ports and data.
package etcdtest

import (
	"net"
	"net/url"
	"path/filepath"
	"testing"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// Etcd is one embedded etcd member.
type Etcd struct {
	t      testing.TB
	dir    string
	logDir string
	client url.URL
	peer   url.URL
	e      *embed.Etcd
}

// Start starts etcd; t.Cleanup stops it.
func Start(t testing.TB) *Etcd {
	t.Helper()
	s := &Etcd{t: t, dir: t.TempDir(), logDir: t.TempDir(), client: freeURL(t), peer: freeURL(t)}
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

func freeURL(t testing.TB) url.URL {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("failed to reserve a loopback port: %v", err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return url.URL{Scheme: "http", Host: addr}
}

// Endpoint is the client URL.
func (s *Etcd) Endpoint() string { return s.client.String() }

// Start starts the member (again) on the same ports and data.
func (s *Etcd) Start() {
	s.t.Helper()
	if s.e != nil {
		return
	}
	cfg := embed.NewConfig()
	cfg.Name = "test"
	cfg.Dir = s.dir
	cfg.Logger = "zap"
	cfg.LogLevel = "warn"
	// etcd logs errors on every clean shutdown; keep them out of test output.
	cfg.LogOutputs = []string{filepath.Join(s.logDir, "etcd.log")}
	cfg.ListenClientUrls = []url.URL{s.client}
	cfg.AdvertiseClientUrls = []url.URL{s.client}
	cfg.ListenPeerUrls = []url.URL{s.peer}
	cfg.AdvertisePeerUrls = []url.URL{s.peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	var err error
	for attempt := range 50 {
		s.e, err = embed.StartEtcd(cfg)
		if err == nil {
			break
		}
		// The old listener's port may take a moment to be free again.
		if attempt == 49 {
			s.t.Fatalf("failed to start etcd: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case <-s.e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		s.e.Close()
		s.t.Fatal("etcd did not become ready within 60s")
	case err := <-s.e.Err():
		s.t.Fatalf("etcd failed: %v", err)
	}
}

// Stop stops the member, keeping its data.
func (s *Etcd) Stop() {
	if s.e == nil {
		return
	}
	s.e.Close()
	s.e = nil
}
