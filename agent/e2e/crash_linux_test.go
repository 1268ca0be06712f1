package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"aether.io/node/agent/app"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/test/harness"
)

func (a *agent) adminPods(t *testing.T) []app.PodView {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", a.admin)
	}}, Timeout: 10 * time.Second}
	resp, err := hc.Get("http://agent/v1/pods")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []app.PodView
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestKill9During100ConcurrentAddPods kills the agent with SIGKILL while
// 100 AddPods are in flight; after a restart every acknowledged AddPod is
// in the store, nothing that was not sent is, and every record is whole.
func TestKill9During100ConcurrentAddPods(t *testing.T) {
	harness.RequireRoot(t)
	dir := newAgentDirs(t)
	mdir := filepath.Join(dir, "manifests")
	if err := os.Mkdir(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	const n = 100
	var docs []string
	for i := 0; i < n; i++ {
		docs = append(docs, podYAML("load", fmt.Sprintf("p-%03d", i), fmt.Sprintf("uid-%03d", i), true, "", ""))
	}
	writeManifest(t, mdir, "load.yaml", strings.Join(docs, "---\n"))
	a := startAgent(t, dir, "--pod-manifests", mdir)
	a.waitReady(t)
	c := a.client(t)

	var (
		mu    sync.Mutex
		acked = map[string]bool{}
		wg    sync.WaitGroup
	)
	ackedEnough := make(chan struct{})
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			cid := fmt.Sprintf("cid-%03d", i)
			r, err := c.AddPod(ctxT(t, 20*time.Second), &cniv1.AddPodRequest{Pod: cniPod("load", fmt.Sprintf("p-%03d", i), cid, fmt.Sprintf("10.9.%d.%d", i/200, i%200+1))})
			if err == nil && r.GetResult() == cniv1.AddPodResponse_RESULT_SUCCESS {
				mu.Lock()
				acked[cid] = true
				if len(acked) == n/5 {
					close(ackedEnough)
				}
				mu.Unlock()
			}
		}(i)
	}
	close(start)
	select {
	case <-ackedEnough:
	case <-time.After(60 * time.Second):
		t.Fatal("no AddPod acknowledged")
	}
	a.kill9()
	wg.Wait()
	mu.Lock()
	nAcked := len(acked)
	mu.Unlock()
	t.Logf("%d of %d AddPods acknowledged before SIGKILL", nAcked, n)

	a = startAgent(t, dir, "--pod-manifests", mdir)
	stored := map[string]app.PodView{}
	for _, v := range a.adminPods(t) {
		stored[v.ContainerID] = v
	}
	for cid := range acked {
		if _, ok := stored[cid]; !ok {
			t.Errorf("acknowledged AddPod %s missing after restart", cid)
		}
	}
	for cid, v := range stored {
		var i int
		if _, err := fmt.Sscanf(cid, "cid-%03d", &i); err != nil || i < 0 || i >= n {
			t.Errorf("stored record %s was never sent", cid)
			continue
		}
		if v.Name != fmt.Sprintf("p-%03d", i) || v.UID != fmt.Sprintf("uid-%03d", i) || len(v.IPs) != 1 ||
			v.IPs[0] != fmt.Sprintf("10.9.%d.%d", i/200, i%200+1) || !v.Registered {
			t.Errorf("stored record %s is not what was sent: %+v", cid, v)
		}
	}
	t.Logf("%d records after restart (%d acknowledged, %d sent)", len(stored), nAcked, n)
	if v := a.metric(t, "aether_agent_store_quarantined_records_total"); v != 0 {
		t.Errorf("quarantined %v records after SIGKILL, want 0", v)
	}
}

// TestCorruptRecordQuarantined: damaged records followed by intact ones
// are moved aside, counted and logged at ERROR; the agent still starts and
// serves every intact record, also those written after the damage.
func TestCorruptRecordQuarantined(t *testing.T) {
	harness.RequireRoot(t)
	dir := newAgentDirs(t)
	mdir := filepath.Join(dir, "manifests")
	if err := os.Mkdir(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	names := []string{"bad-1", "good-1", "bad-2", "good-2"}
	var docs []string
	for _, n := range names {
		docs = append(docs, podYAML("shop", n, "uid-"+n, true, "", ""))
	}
	writeManifest(t, mdir, "pods.yaml", strings.Join(docs, "---\n"))
	a := startAgent(t, dir, "--pod-manifests", mdir)
	a.waitReady(t)
	for i, n := range names {
		r, err := a.client(t).AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", n, "cid-"+n, fmt.Sprintf("10.3.0.%d", i+1))})
		if err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
			t.Fatalf("AddPod %s = %v, %v", n, r, err)
		}
	}
	a.terminate(t)

	// Damage: one flipped bit in every frame of the bad pods; the good
	// pods' frames follow each of them.
	path := filepath.Join(a.state, store.FileName)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	hits := 0
	for _, id := range []string{`"cid-bad-1"`, `"cid-bad-2"`} {
		for off := 0; ; {
			i := bytes.Index(data[off:], []byte(id))
			if i < 0 {
				break
			}
			data[off+i+2] ^= 0x20 // "cid" → "cId": the frame's checksum no longer matches
			off += i + len(id)
			hits++
		}
	}
	if hits < 2 {
		t.Fatalf("found %d frames of the bad pods in %s", hits, path)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}

	a = startAgent(t, dir, "--pod-manifests", mdir)
	views := a.adminPods(t)
	var got []string
	for _, v := range views {
		got = append(got, v.ContainerID)
	}
	sort.Strings(got)
	if strings.Join(got, ",") != "cid-good-1,cid-good-2" {
		t.Fatalf("records after quarantine = %v, want cid-good-1,cid-good-2", got)
	}
	v := a.metric(t, "aether_agent_store_quarantined_records_total")
	n := 0
	for _, l := range a.logs.logLines() {
		if l["msg"] == "quarantined corrupt pod record" && l["level"] == "ERROR" {
			n++
		}
	}
	if v < 2 || float64(n) != v {
		t.Fatalf("quarantined count = %v with %d ERROR lines; want at least 2 (one per damaged run of frames), one line each", v, n)
	}
	// The next start finds nothing new to quarantine.
	a.terminate(t)
	a = startAgent(t, dir, "--pod-manifests", mdir)
	if v := a.metric(t, "aether_agent_store_quarantined_records_total"); v != 0 {
		t.Fatalf("quarantined again on the next start: %v", v)
	}
}
