package identity_test

import (
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/identity"
)

// The watcher is the certificate source HBONE consumes: this fails to
// compile when the two drift apart.
var _ hbone.Certs = (*identity.Watcher)(nil)
