// Package istio pairs aether-proxy's HBONE (proxy/hbone) with Istio's Go
// implementation (istio.io/istio/pkg/hbone) in both directions, and
// benchmarks the two between the same endpoints. It is a separate Go module
// so the main go.mod does not pull Istio; `make test-interop` runs it.
package istio
