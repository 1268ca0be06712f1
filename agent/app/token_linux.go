package app

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"

	"aether.io/node/pkg/meshcontract"
)

// tokenBytes is the size of the Workload API token's random secret.
const tokenBytes = 32

// WorkloadAPITokenPath is the token file of the Workload API socket at
// socket: meshcontract.WorkloadAPITokenFile in the socket's directory
// (the directory aether-proxy mounts).
func WorkloadAPITokenPath(socket string) string {
	return filepath.Join(filepath.Dir(socket), meshcontract.WorkloadAPITokenFile)
}

// writeWorkloadAPIToken writes a fresh token (tokenBytes from crypto/rand,
// hex) to path, mode 0600, atomically: a temporary file in the same
// directory, synced, then renamed over path, so a reader sees the old
// token or the new one, never a part. It returns the token.
func writeWorkloadAPIToken(path string) (string, error) {
	secret := make([]byte, tokenBytes)
	if _, err := rand.Read(secret); err != nil {
		return "", fmt.Errorf("failed to generate the workload api token: %w", err)
	}
	tok := hex.EncodeToString(secret)
	f, err := os.CreateTemp(filepath.Dir(path), tokenTempPrefix+"*") // 0600
	if err != nil {
		return "", fmt.Errorf("failed to create the workload api token file %q: %w", path, err)
	}
	tmp := f.Name()
	err = func() error {
		if _, err := f.WriteString(tok + "\n"); err != nil {
			return err
		}
		if err := f.Chmod(0o600); err != nil {
			return err
		}
		return f.Sync()
	}()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("failed to write the workload api token file %q: %w", path, err)
	}
	return tok, nil
}
