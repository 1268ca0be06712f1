package meshcontract

// The socket contract between aether-agent and aether-proxy. The agent
// serves from two directories, split by audience:
//
//   - AgentSocketDir holds the sockets only node components call (the CNI
//     socket aether-cni dials, the admin socket aetherctl reads); the proxy
//     never sees it;
//   - ProxySocketDir holds what aether-proxy consumes: workload and
//     listener discovery, the SPIFFE Workload API, and the Workload API
//     token (WorkloadAPITokenFile). The proxy mounts this directory and
//     nothing else of /run/aether.
//
// Both binaries build their default paths from these constants, so the two
// cannot drift.
const (
	// AgentSocketDir is the directory of the agent's private sockets.
	AgentSocketDir = "/run/aether/agent"
	// ProxySocketDir is the directory of the sockets aether-proxy uses.
	ProxySocketDir = "/run/aether/proxy"

	// CNISocketName and AdminSocketName are the agent-private sockets'
	// file names in AgentSocketDir.
	CNISocketName   = "cni.sock"
	AdminSocketName = "admin.sock"
	// XDSSocketName, LDSSocketName and WorkloadAPISocketName are the proxy
	// sockets' file names in ProxySocketDir.
	XDSSocketName         = "xds.sock"
	LDSSocketName         = "lds.sock"
	WorkloadAPISocketName = "workload.sock"

	// WorkloadAPITokenFile is the name of the file, next to the Workload
	// API socket, that holds the token every Workload API call must carry
	// (hex, rewritten by every agent start; mode 0600).
	WorkloadAPITokenFile = "workload-api.token"
	// WorkloadAPITokenMetadata is the gRPC metadata key that carries the
	// token on every Workload API call.
	WorkloadAPITokenMetadata = "x-aether-workload-api-token"
)
