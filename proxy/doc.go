// Package proxy wires aether-proxy together: the delta ADS client of the
// agent (Listener and istio.workload.Workload resources), the WDS peer index,
// the data plane that serves each pod's listeners inside its netns, the
// SPIFFE Workload API watch (proxy/identity), the admin HTTP server
// (/metrics, /healthz, /debug/pods) and the flows socket (proxy/flowserver,
// `aetherctl flows`). See README.md.
package proxy
