package identity

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/credentials"

	"aether.io/node/pkg/meshcontract"
)

// DefaultTokenFile is the Workload API token file next to the Workload API
// socket at socket (meshcontract.WorkloadAPITokenFile in its directory),
// where aether-agent writes it.
func DefaultTokenFile(socket string) string {
	return filepath.Join(filepath.Dir(socket), meshcontract.WorkloadAPITokenFile)
}

// TokenCredentials are gRPC per-RPC credentials that send the token in
// the file at path (meshcontract.WorkloadAPITokenMetadata) on every call.
// The file is read at every call, not once: aether-agent writes a new
// token at each start, and the watch's reconnect after an agent restart
// is a new call that picks the new one up. A missing or empty file fails
// the call with Unavailable, which the watch retries.
func TokenCredentials(path string) credentials.PerRPCCredentials { return tokenCreds{path: path} }

type tokenCreds struct{ path string }

func (t tokenCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	b, err := os.ReadFile(t.path)
	if err != nil {
		return nil, fmt.Errorf("failed to read the workload api token %q (aether-agent writes it when it serves the workload api): %w", t.path, err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return nil, fmt.Errorf("failed to read the workload api token %q: the file is empty", t.path)
	}
	return map[string]string{meshcontract.WorkloadAPITokenMetadata: tok}, nil
}

// RequireTransportSecurity is false: the token goes over a unix socket
// only the node's root can open.
func (tokenCreds) RequireTransportSecurity() bool { return false }
