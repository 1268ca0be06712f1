package cniinstall

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// Schema versions of the state file. Version 1 is a chain inserted into a
// regular file; version 2 adds a chain written through a symlink and one in
// the network's plugin directory. A state that needs none of version 2's
// fields is still written as version 1, so an older installer (a rollback)
// can undo it; one that does is version 2, which an older installer
// refuses loudly rather than undoing it wrongly.
const (
	stateVersion1 = 1
	stateVersion2 = 2
)

// LayoutPluginDir is State.Layout of a chain written as its own plugin
// file in the network's plugin directory (CNI spec 1.1:
// <conf dir>/<network name>/*.conf, loaded after the inline plugins).
const LayoutPluginDir = "plugin_dir"

// State is what the installer needs to undo its chain, kept in a file
// outside the conf dir so the runtime never reads it and an installer
// restart (a new DaemonSet pod) still restores exactly.
type State struct {
	// Version is the schema version.
	Version int `json:"version"`
	// Original is the primary the installer found (the runtime's file).
	Original string `json:"original"`
	// OriginalBytes is its content before aether-cni was chained (the
	// owner's latest version; refreshed on every repair). Empty for
	// LayoutPluginDir: the primary itself is never written then.
	OriginalBytes []byte `json:"original_bytes"`
	// OriginalMode is its permission bits.
	OriginalMode fs.FileMode `json:"original_mode"`
	// OriginalLink is the link text when Original was a symlink that the
	// conversion of a single-plugin file removed; uninstall re-creates the
	// link instead of writing the bytes.
	OriginalLink string `json:"original_link,omitempty"`
	// Layout is "" for a chain inserted into the primary's "plugins" (or
	// into the conflist a single-plugin file became), LayoutPluginDir for
	// one written as a plugin file of the network's plugin directory.
	Layout string `json:"layout,omitempty"`
	// Written is the file the installer wrote: Original, ListPath(Original)
	// when a single-plugin file was converted, or the plugin file for
	// LayoutPluginDir.
	Written string `json:"written"`
	// WrittenTarget is the regular file the bytes went to when Written is
	// a symlink (the link is kept and its target written); "" otherwise.
	WrittenTarget string `json:"written_target,omitempty"`
	// WrittenSHA256 is the hex SHA-256 of what the installer wrote there.
	WrittenSHA256 string `json:"written_sha256"`
}

// Converted reports whether the primary was a single-plugin file that the
// installer replaced by a conflist.
func (s *State) Converted() bool { return s.Layout == "" && s.Original != s.Written }

// file is the regular file holding what the installer wrote.
func (s *State) file() string {
	if s.WrittenTarget != "" {
		return s.WrittenTarget
	}
	return s.Written
}

func sha256Hex(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// loadState reads the state file; nil when there is none.
func loadState(path string) (*State, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("failed to read state file %q: %w", path, err)
	}
	s := &State{}
	if err := json.Unmarshal(data, s); err != nil {
		return nil, fmt.Errorf("failed to parse state file %q (delete it to forget the previous install): %w", path, err)
	}
	if (s.Version != stateVersion1 && s.Version != stateVersion2) || s.Original == "" || s.Written == "" ||
		(s.Layout != "" && s.Layout != LayoutPluginDir) {
		return nil, fmt.Errorf("failed to parse state file %q: want version %d or %d with original and written paths and layout \"\" or %q (delete it to forget the previous install)", path, stateVersion1, stateVersion2, LayoutPluginDir)
	}
	return s, nil
}

// saveState writes the state file atomically, creating its directory.
func saveState(path string, s *State) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("failed to create state directory %q: %w", filepath.Dir(path), err)
	}
	s.Version = stateVersion1
	if s.Layout != "" || s.WrittenTarget != "" || s.OriginalLink != "" {
		s.Version = stateVersion2
	}
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("failed to encode state file %q: %w", path, err)
	}
	if err := WriteFileAtomic(path, data, 0o600); err != nil {
		return fmt.Errorf("failed to write state file %q: %w", path, err)
	}
	return nil
}

func removeState(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("failed to remove state file %q: %w", path, err)
	}
	return nil
}
