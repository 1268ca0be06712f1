package kubetest

import "crypto/tls"

// insecureTLS trusts the apiserver's self-signed test certificate.
func insecureTLS() *tls.Config { return &tls.Config{InsecureSkipVerify: true} } //nolint:gosec // test-only apiserver
