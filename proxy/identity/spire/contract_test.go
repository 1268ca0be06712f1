package spire_test

import (
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/identity"
	"aether.io/node/proxy/identity/spire"
)

// The SPIRE provider is a certificate source HBONE consumes and an identity
// provider the proxy runs: this fails to compile when they drift apart.
var (
	_ hbone.Certs       = (*spire.Provider)(nil)
	_ identity.Provider = (*spire.Provider)(nil)
)
