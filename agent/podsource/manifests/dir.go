package manifests

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// Sink takes the objects of a manifest directory: all of them, after
// every scan that found a change.
type Sink interface {
	ReplaceFrom(Objects)
}

// Dir feeds sinks (the agent's Service and policy models) from a directory
// of manifests, the one the pod source reads (standalone nodes, the demo):
// every scan that finds a changed, added or removed file hands each sink
// the directory's objects.
type Dir struct {
	dir      string
	interval time.Duration
	sinks    []Sink
	log      *slog.Logger
	files    map[string]dirFile
	synced   chan struct{}
}

type dirFile struct {
	size int64
	mod  time.Time
	objs Objects
}

// NewDir returns the directory source of sinks; interval <= 0 means 1 s.
func NewDir(dir string, interval time.Duration, log *slog.Logger, sinks ...Sink) *Dir {
	if interval <= 0 {
		interval = time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Dir{dir: dir, interval: interval, sinks: sinks, log: log, files: map[string]dirFile{}, synced: make(chan struct{})}
}

// Synced is closed after the first scan.
func (d *Dir) Synced() <-chan struct{} { return d.synced }

// Run scans the directory every interval until ctx ends.
func (d *Dir) Run(ctx context.Context) error {
	if st, err := os.Stat(d.dir); err != nil {
		return fmt.Errorf("failed to open manifest dir %q: %w", d.dir, err)
	} else if !st.IsDir() {
		return fmt.Errorf("failed to open manifest dir %q: not a directory", d.dir)
	}
	d.Scan()
	close(d.synced)
	t := time.NewTicker(d.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			d.Scan()
		}
	}
}

// Scan re-reads changed files and hands the sinks the directory's
// objects (a file that does not parse keeps its previous content and is
// logged once).
func (d *Dir) Scan() {
	ents, err := os.ReadDir(d.dir)
	if err != nil {
		d.log.Error("failed to read manifest dir", "dir", d.dir, "error", err.Error())
		return
	}
	changed := false
	seen := map[string]bool{}
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() || strings.HasPrefix(name, ".") || !slices.Contains([]string{".yaml", ".yml", ".json"}, strings.ToLower(filepath.Ext(name))) {
			continue
		}
		path := filepath.Join(d.dir, name)
		info, err := e.Info()
		if err != nil {
			continue
		}
		seen[path] = true
		if old, ok := d.files[path]; ok && old.size == info.Size() && old.mod.Equal(info.ModTime()) {
			continue
		}
		data, err := os.ReadFile(path)
		if err != nil {
			d.log.Error("failed to read manifest", "path", path, "error", err.Error())
			continue
		}
		objs, err := ParseObjects(data)
		if err != nil {
			// Logged once per content: the file keeps its previous
			// objects until it parses again.
			d.log.Error("failed to parse manifest; keeping its previous content", "path", path, "error", err.Error())
			d.files[path] = dirFile{size: info.Size(), mod: info.ModTime(), objs: d.files[path].objs}
			continue
		}
		d.files[path] = dirFile{size: info.Size(), mod: info.ModTime(), objs: objs}
		changed = true
	}
	for path := range d.files {
		if !seen[path] {
			delete(d.files, path)
			changed = true
		}
	}
	if !changed {
		return
	}
	var all Objects
	for _, path := range slices.Sorted(maps.Keys(d.files)) {
		o := d.files[path].objs
		all.Pods = append(all.Pods, o.Pods...)
		all.Services = append(all.Services, o.Services...)
		all.EndpointSlices = append(all.EndpointSlices, o.EndpointSlices...)
		all.AuthorizationPolicies = append(all.AuthorizationPolicies, o.AuthorizationPolicies...)
		all.PeerAuthentications = append(all.PeerAuthentications, o.PeerAuthentications...)
	}
	for _, s := range d.sinks {
		s.ReplaceFrom(all)
	}
}
