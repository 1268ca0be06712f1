package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"aether.io/node/agent/policy"
)

// snapshotFile holds, in the state directory, the cluster objects the agent
// serves besides its pods (Services, EndpointSlices, AuthorizationPolicies,
// PeerAuthentications), so an agent restarted while the API server is away
// serves them again at once, as it serves its stored pods.
const snapshotFile = "cluster-objects.json"

// snapshotInterval is how often a changed snapshot is written.
const snapshotInterval = 2 * time.Second

// clusterSnapshot is the file's content.
type clusterSnapshot struct {
	Version               int                          `json:"version"`
	Written               time.Time                    `json:"written"`
	Services              []*corev1.Service            `json:"services"`
	EndpointSlices        []*discoveryv1.EndpointSlice `json:"endpointSlices"`
	AuthorizationPolicies []json.RawMessage            `json:"authorizationPolicies"`
	PeerAuthentications   []json.RawMessage            `json:"peerAuthentications"`
}

// restoreSnapshot feeds the models from the state directory's snapshot
// (none: nothing to do; unreadable: logged, the informers fill the models).
// The informers replace it with the API's content once they sync.
func (a *agent) restoreSnapshot() {
	n := a.nodeRes
	path := filepath.Join(a.c.StateDir, snapshotFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	var s clusterSnapshot
	if err == nil {
		err = json.Unmarshal(b, &s)
	}
	if err == nil && s.Version != 1 {
		err = fmt.Errorf("version %d, want 1", s.Version)
	}
	if err != nil {
		a.log.Warn("cluster object snapshot unreadable; serving Services and policies once the API answers", "path", path, "error", err.Error())
		return
	}
	n.services.Replace(s.Services, s.EndpointSlices)
	var objs []*policy.Object
	for _, raw := range s.AuthorizationPolicies {
		if o, _ := policy.ParseObject(raw); o != nil {
			objs = append(objs, o)
		}
	}
	n.policies.Replace(objs)
	var peers []*policy.PeerObject
	for _, raw := range s.PeerAuthentications {
		if p, err := policy.ParsePeerObject(raw); err == nil {
			peers = append(peers, p)
		}
	}
	n.policies.ReplacePeers(peers)
	a.log.Info("cluster objects restored from the state directory", "written", s.Written.Format(time.RFC3339),
		"services", len(s.Services), "endpointslices", len(s.EndpointSlices), "authorization_policies", len(objs), "peer_authentications", len(peers))
}

// runSnapshots writes the snapshot whenever the models changed (checked
// every snapshotInterval, and once more when ctx ends).
func (a *agent) runSnapshots(ctx context.Context) error {
	n := a.nodeRes
	var last uint64
	write := func() {
		gen := n.services.Generation() + n.policies.Generation()
		if gen == last {
			return
		}
		if err := a.writeSnapshot(); err != nil {
			a.log.Error("failed to write the cluster object snapshot", "error", err.Error())
			return
		}
		last = gen
	}
	t := time.NewTicker(snapshotInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			write()
			return nil
		case <-t.C:
			write()
		}
	}
}

// writeSnapshot writes the models' objects atomically (a temporary file
// in the state directory, synced, renamed over the snapshot).
func (a *agent) writeSnapshot() error {
	n := a.nodeRes
	s := clusterSnapshot{Version: 1, Written: time.Now().UTC()}
	s.Services, s.EndpointSlices = n.services.Snapshot()
	pols, peers := n.policies.Snapshot()
	for _, p := range pols {
		s.AuthorizationPolicies = append(s.AuthorizationPolicies, p)
	}
	for _, p := range peers {
		s.PeerAuthentications = append(s.PeerAuthentications, p)
	}
	b, err := json.Marshal(&s)
	if err != nil {
		return fmt.Errorf("failed to encode the cluster object snapshot: %w", err)
	}
	path := filepath.Join(a.c.StateDir, snapshotFile)
	f, err := os.CreateTemp(a.c.StateDir, ".cluster-objects-*")
	if err != nil {
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("failed to write %q: %w", path, err)
	}
	return nil
}
