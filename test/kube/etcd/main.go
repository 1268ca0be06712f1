// Command etcd runs a single-member etcd from go.etcd.io/etcd/server/v3/embed
// for tests: data in --data-dir, clients on --listen-client-url, no fsync.
// It prints "READY" on stdout once the server serves, and exits on SIGTERM.
package main

import (
	"flag"
	"fmt"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	dataDir := flag.String("data-dir", "", "etcd data directory (required)")
	client := flag.String("listen-client-url", "http://127.0.0.1:23790", "client URL to listen on and advertise")
	peer := flag.String("listen-peer-url", "http://127.0.0.1:23800", "peer URL to listen on")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}
	cu, err := url.Parse(*client)
	if err != nil {
		log.Fatalf("failed to parse client url %q: %v", *client, err)
	}
	pu, err := url.Parse(*peer)
	if err != nil {
		log.Fatalf("failed to parse peer url %q: %v", *peer, err)
	}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*cu}
	cfg.AdvertiseClientUrls = []url.URL{*cu}
	cfg.ListenPeerUrls = []url.URL{*pu}
	cfg.AdvertisePeerUrls = []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "error"
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("failed to start etcd: %v", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Close()
		log.Fatal("etcd was not ready within 60s")
	}
	fmt.Println("READY")
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-sig:
	case err := <-e.Err():
		log.Printf("etcd failed: %v", err)
	}
	e.Close()
}
