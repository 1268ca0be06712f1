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

// stateVersion is the schema version of the state file.
const stateVersion = 1

// State is what the installer needs to undo its chain, kept in a file
// outside the conf dir so the runtime never reads it and an installer
// restart (a new DaemonSet pod) still restores exactly.
type State struct {
	// Version is the schema version.
	Version int `json:"version"`
	// Original is the primary the installer found (the runtime's file).
	Original string `json:"original"`
	// OriginalBytes is its content before aether-cni was chained (the
	// owner's latest version; refreshed on every repair).
	OriginalBytes []byte `json:"original_bytes"`
	// OriginalMode is its permission bits.
	OriginalMode fs.FileMode `json:"original_mode"`
	// Written is the conflist the installer wrote: Original, or
	// ListPath(Original) when a single-plugin file was converted.
	Written string `json:"written"`
	// WrittenSHA256 is the hex SHA-256 of what the installer wrote there.
	WrittenSHA256 string `json:"written_sha256"`
}

// Converted reports whether the primary was a single-plugin file that the
// installer replaced by a conflist.
func (s *State) Converted() bool { return s.Original != s.Written }

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
	if s.Version != stateVersion || s.Original == "" || s.Written == "" {
		return nil, fmt.Errorf("failed to parse state file %q: want version %d with original and written paths (delete it to forget the previous install)", path, stateVersion)
	}
	return s, nil
}

// saveState writes the state file atomically, creating its directory.
func saveState(path string, s *State) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("failed to create state directory %q: %w", filepath.Dir(path), err)
	}
	s.Version = stateVersion
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
