package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/containernetworking/cni/libcni"
)

// PluginFileName is the plugin file the installer adds to a network's
// plugin directory (CNI spec 1.1 layout: <conf dir>/<network name>/*.conf,
// loaded in lexical order after the inline plugins). When another file
// sorts at or after it, the name becomes that file's name without ".conf"
// followed by "~" and PluginFileName, which sorts after it ('~' is after
// '.').
const PluginFileName = "zz-aether-cni.conf"

// pluginExtensions are the plugin files libcni reads from a network's
// plugin directory (libcni.NetworkPluginConfsFromFiles).
var pluginExtensions = []string{".conf"}

// pluginDirOf is the plugin directory libcni reads for primary p.
func pluginDirOf(p *Primary) string {
	return filepath.Join(filepath.Dir(p.Path), p.List.Name)
}

// pluginFile is one plugin file of a network's plugin directory.
type pluginFile struct {
	path string
	data []byte
	ours bool
}

// layoutFor says where aether-cni goes for primary p so that it is the
// last plugin of the chain libcni builds: into the primary's "plugins"
// ("") unless libcni also loads the network's plugin directory and that
// holds a plugin the installer did not write (LayoutPluginDir).
func (i *Installer) layoutFor(p *Primary, st *State) (string, error) {
	if !isList(p.Path) || p.List.LoadOnlyInlinedPlugins {
		return "", nil
	}
	files, err := pluginFiles(pluginDirOf(p), st)
	if err != nil {
		return "", err
	}
	for _, f := range files {
		if !f.ours {
			return LayoutPluginDir, nil
		}
	}
	return "", nil
}

// pluginFiles lists a plugin directory as libcni loads it (libcni.ConfFiles
// with ".conf", in its order) and marks the files the installer wrote: the
// bytes recorded in st, or st's file still holding an aether-cni plugin.
func pluginFiles(dir string, st *State) ([]pluginFile, error) {
	paths, err := libcni.ConfFiles(dir, pluginExtensions)
	if err != nil {
		return nil, fmt.Errorf("failed to list plugin directory %q: %w", dir, err)
	}
	out := make([]pluginFile, 0, len(paths))
	for _, f := range paths {
		data, err := os.ReadFile(f)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since the listing
		}
		if err != nil {
			return nil, fmt.Errorf("failed to read plugin file %q: %w", f, err)
		}
		ours := st != nil && st.Layout == LayoutPluginDir &&
			(sha256Hex(data) == st.WrittenSHA256 || (f == st.Written && isPlugin(data)))
		out = append(out, pluginFile{path: f, data: data, ours: ours})
	}
	return out, nil
}

// isPlugin reports whether data is an aether-cni plugin object.
func isPlugin(data []byte) bool {
	c, err := libcni.NetworkPluginConfFromBytes(data)
	return err == nil && c.Network.Type == PluginType
}

// pluginFileName is the name of the installer's plugin file given the
// other files' names, in lexical order: PluginFileName, or a name that
// sorts after the last of them.
func pluginFileName(others []string) string {
	if n := len(others); n > 0 && others[n-1] >= PluginFileName {
		return strings.TrimSuffix(others[n-1], ".conf") + "~" + PluginFileName
	}
	return PluginFileName
}

// reconcilePluginDir keeps one installer plugin file as the last file of
// the primary's plugin directory. The primary itself and the owner's
// plugin files are never written.
func (i *Installer) reconcilePluginDir(p *Primary, st *State) (Outcome, error) {
	name := p.List.Name
	if name == "" || name == "." || name == ".." || filepath.Base(name) != name {
		return Unchanged, fmt.Errorf("failed to chain primary %q: its plugins are in the plugin directory of network %q, which is not one plain directory name in the conf dir; the installer only writes inside the conf dir", p.Path, name)
	}
	if st == nil && chainHas(p.List) {
		return Foreign, nil
	}
	dir := pluginDirOf(p)
	files, err := pluginFiles(dir, st)
	if err != nil {
		return Unchanged, err
	}
	var (
		ours   []pluginFile
		others []string
	)
	for _, f := range files {
		if f.ours {
			ours = append(ours, f)
		} else {
			others = append(others, filepath.Base(f.path))
		}
	}
	if st != nil && len(ours) == 1 && files[len(files)-1].ours {
		if ours[0].path != st.Written { // a move interrupted before its state
			st.Written = ours[0].path
			if err := saveState(i.cfg.StateFile, st); err != nil {
				return Unchanged, err
			}
		}
		return Unchanged, nil
	}
	target := filepath.Join(dir, pluginFileName(others))
	entry := append(bytes.TrimSpace(bytes.Clone(i.cfg.Entry)), '\n')
	var keep *pluginFile
	for k := range ours {
		if keep == nil || ours[k].path == st.Written {
			keep = &ours[k]
		}
	}
	written := entry
	if keep != nil {
		written = keep.data
	}
	mode := fs.FileMode(0o644)
	if fi, err := os.Stat(p.Path); err == nil {
		mode = fi.Mode().Perm()
	}
	// The state first: a crash before the file is in place leaves a state
	// whose bytes identify every file of ours.
	nst := &State{Original: p.Path, OriginalMode: mode, Layout: LayoutPluginDir, Written: target, WrittenSHA256: sha256Hex(written)}
	if err := saveState(i.cfg.StateFile, nst); err != nil {
		return Unchanged, err
	}
	switch {
	case keep == nil:
		if err := WriteFileAtomic(target, entry, mode); err != nil {
			return Unchanged, fmt.Errorf("failed to write plugin file %q: %w", target, err)
		}
	case keep.path != target:
		// One rename: the runtime sees aether-cni under the old name or
		// the new one, never twice and never missing.
		if err := os.Rename(keep.path, target); err != nil {
			return Unchanged, fmt.Errorf("failed to rename plugin file %q to %q: %w", keep.path, target, err)
		}
		if err := syncDir(dir); err != nil {
			return Unchanged, err
		}
	}
	for _, f := range ours {
		if keep != nil && f.path == keep.path {
			continue
		}
		if err := os.Remove(f.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return Unchanged, fmt.Errorf("failed to remove plugin file %q: %w", f.path, err)
		}
	}
	i.log.Info("aether-cni chained as the last file of the network's plugin directory", "primary", p.Path, "path", target)
	if st == nil {
		return Chained, nil
	}
	return Repaired, nil
}

// releasePluginDir removes the installer's plugin files (its bytes, or its
// file still holding an aether-cni plugin); nothing else of the plugin
// directory or the primary is touched.
func (i *Installer) releasePluginDir(st *State) error {
	dir := filepath.Dir(st.Written)
	files, err := pluginFiles(dir, st)
	if err != nil {
		return err
	}
	removed := 0
	for _, f := range files {
		if !f.ours {
			continue
		}
		if err := os.Remove(f.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("failed to remove plugin file %q: %w", f.path, err)
		}
		removed++
	}
	if err := syncDir(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	i.log.Info("plugin file removed from the network's plugin directory", "primary", st.Original, "path", st.Written, "removed", removed)
	return nil
}
