// Package config parses and validates the eni-vlan network configuration
// (seed 004): master, mtu, linkInContainer, validateIaasNetConfig,
// validationRetries, validationTimeoutMs and ipam, plus the documented
// extensions spiderpoolSocket and endpointTimeoutMs. Static VLAN fields
// (vlanId, vlanMode) are rejected: that is the community vlan plugin's job.
package config

import (
	"bytes"
	"encoding/json"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"aether.io/node/pkg/cniutil"
)

// Defaults of the optional fields.
const (
	DefaultValidationRetries   = 3
	DefaultValidationTimeoutMs = 500
	DefaultSpiderpoolSocket    = "/var/run/spidernet/spiderpool.sock"
	DefaultEndpointTimeoutMs   = 20000
	// MaxValidationRetries bounds the pre-flight attempts so a typo cannot
	// hold a pod sandbox for minutes.
	MaxValidationRetries = 20
	// MaxValidationTimeoutMs bounds one pre-flight attempt.
	MaxValidationTimeoutMs = 10000
	// MaxEndpointTimeoutMs keeps the workload-endpoint lookup budget well
	// under kubelet's 2 min sandbox budget.
	MaxEndpointTimeoutMs = 90000
)

// IPAM is the delegated IPAM section; Raw keeps every key for the delegate.
type IPAM struct {
	// Type is the IPAM plugin binary name (spiderpool in production).
	Type string `json:"type"`
	// SocketPath is spiderpool IPAM's ipam_unix_socket_path, honoured as the
	// agent socket when spiderpoolSocket is not set.
	SocketPath string `json:"ipam_unix_socket_path,omitempty"`
}

// NetConf is the eni-vlan network configuration.
type NetConf struct {
	types.NetConf

	// Master is the host interface (the ENI) the VLAN sub-interface sits on.
	Master string `json:"master"`
	// MTU of the sub-interface; 0 means the master's MTU.
	MTU int `json:"mtu,omitempty"`
	// LinkInContainer says the master lives in the pod netns.
	LinkInContainer bool `json:"linkInContainer,omitempty"`
	// ValidateIaasNetConfig enables the ARP/NDP pre-flight.
	ValidateIaasNetConfig bool `json:"validateIaasNetConfig,omitempty"`
	// ValidationRetries is the number of pre-flight attempts per family.
	ValidationRetries int `json:"validationRetries,omitempty"`
	// ValidationTimeoutMs is the reply timeout of one attempt.
	ValidationTimeoutMs int `json:"validationTimeoutMs,omitempty"`
	// SpiderpoolSocket is the spiderpool-agent unix socket (extension).
	SpiderpoolSocket string `json:"spiderpoolSocket,omitempty"`
	// EndpointTimeoutMs bounds the spiderpool-agent workload-endpoint lookup
	// including its retries (extension).
	EndpointTimeoutMs int `json:"endpointTimeoutMs,omitempty"`
	// StateDir holds the per-(master, VLAN) ownership records (extension).
	StateDir string `json:"stateDir,omitempty"`

	// IPAMConf is the parsed ipam section (types.NetConf.IPAM has only type).
	IPAMConf IPAM `json:"-"`
}

// DefaultStateDir is where ownership records live when stateDir is unset.
const DefaultStateDir = "/var/lib/cni/eni-vlan"

// ValidationTimeout returns the per-attempt timeout.
func (c *NetConf) ValidationTimeout() time.Duration {
	return time.Duration(c.ValidationTimeoutMs) * time.Millisecond
}

// EndpointTimeout returns the workload-endpoint lookup budget.
func (c *NetConf) EndpointTimeout() time.Duration {
	return time.Duration(c.EndpointTimeoutMs) * time.Millisecond
}

// raw mirrors NetConf with pointers so absent and zero can be told apart
// and wrong JSON types are reported per field.
type raw struct {
	Master                *json.RawMessage `json:"master"`
	MTU                   *json.RawMessage `json:"mtu"`
	LinkInContainer       *json.RawMessage `json:"linkInContainer"`
	ValidateIaasNetConfig *json.RawMessage `json:"validateIaasNetConfig"`
	ValidationRetries     *json.RawMessage `json:"validationRetries"`
	ValidationTimeoutMs   *json.RawMessage `json:"validationTimeoutMs"`
	SpiderpoolSocket      *json.RawMessage `json:"spiderpoolSocket"`
	EndpointTimeoutMs     *json.RawMessage `json:"endpointTimeoutMs"`
	StateDir              *json.RawMessage `json:"stateDir"`
	VlanID                *json.RawMessage `json:"vlanId"`
	VlanMode              *json.RawMessage `json:"vlanMode"`
	IPAM                  *json.RawMessage `json:"ipam"`
}

func field(name string, m *json.RawMessage, dst any, want string) error {
	if m == nil {
		return nil
	}
	if bytes.Equal(bytes.TrimSpace(*m), []byte("null")) {
		return cniutil.InvalidConfigf("invalid %q: null is not allowed; want %s", name, want)
	}
	if err := json.Unmarshal(*m, dst); err != nil {
		return cniutil.InvalidConfigf("invalid %q %s: want %s", name, *m, want)
	}
	return nil
}

// Parse decodes and validates stdin for ADD, CHECK and STATUS. Every error
// is of class cniutil.ErrInvalidConfig (CNI code 7) and names the field and
// what is allowed. The master's existence and MTU are checked later, in the
// namespace where the master lives.
func Parse(stdin []byte) (*NetConf, error) {
	c, r, err := decode(stdin)
	if err != nil {
		return nil, err
	}
	if r.VlanID != nil {
		return nil, cniutil.InvalidConfigf("field \"vlanId\" is not supported: eni-vlan takes the VLAN ID from spiderpool-agent (cloud-allocated); for a static VLAN use the community vlan CNI plugin (\"type\": \"vlan\")")
	}
	if r.VlanMode != nil {
		return nil, cniutil.InvalidConfigf("field \"vlanMode\" is not supported: eni-vlan always takes VLAN ID and MAC from spiderpool-agent; for a static VLAN use the community vlan CNI plugin (\"type\": \"vlan\")")
	}
	if c.Master == "" {
		return nil, cniutil.InvalidConfigf("field \"master\" is required: the host interface (ENI) the VLAN sub-interface attaches to, for example \"eth0\"")
	}
	if len(c.Master) > 15 {
		return nil, cniutil.InvalidConfigf("invalid \"master\" %q: an interface name has at most 15 bytes", c.Master)
	}
	if c.MTU < 0 || c.MTU > 65535 {
		return nil, cniutil.InvalidConfigf("invalid \"mtu\" %d: want 0 (use the master's MTU) or 68..65535, no more than the master's MTU", c.MTU)
	}
	if c.MTU > 0 && c.MTU < 68 {
		return nil, cniutil.InvalidConfigf("invalid \"mtu\" %d: want 0 (use the master's MTU) or 68..65535, no more than the master's MTU", c.MTU)
	}
	if r.ValidationRetries != nil && (c.ValidationRetries < 1 || c.ValidationRetries > MaxValidationRetries) {
		return nil, cniutil.InvalidConfigf("invalid \"validationRetries\" %d: want 1..%d (default %d)", c.ValidationRetries, MaxValidationRetries, DefaultValidationRetries)
	}
	if r.ValidationTimeoutMs != nil && (c.ValidationTimeoutMs < 1 || c.ValidationTimeoutMs > MaxValidationTimeoutMs) {
		return nil, cniutil.InvalidConfigf("invalid \"validationTimeoutMs\" %d: want 1..%d (default %d)", c.ValidationTimeoutMs, MaxValidationTimeoutMs, DefaultValidationTimeoutMs)
	}
	if r.EndpointTimeoutMs != nil && (c.EndpointTimeoutMs < 1 || c.EndpointTimeoutMs > MaxEndpointTimeoutMs) {
		return nil, cniutil.InvalidConfigf("invalid \"endpointTimeoutMs\" %d: want 1..%d (default %d)", c.EndpointTimeoutMs, MaxEndpointTimeoutMs, DefaultEndpointTimeoutMs)
	}
	if r.IPAM == nil || c.IPAMConf.Type == "" {
		return nil, cniutil.InvalidConfigf("field \"ipam\" is required and needs a \"type\" (for example {\"type\": \"spiderpool\"})")
	}
	return c, nil
}

// ParseForDel decodes stdin for DEL and GC: it needs only what releasing
// IPAM and finding the link take, so legacy fields and out-of-range knobs
// do not block the release. Only undecodable JSON or a missing ipam type
// is an error.
func ParseForDel(stdin []byte) (*NetConf, error) {
	c, _, err := decode(stdin)
	if err != nil {
		return nil, err
	}
	if c.IPAMConf.Type == "" {
		return nil, cniutil.InvalidConfigf("field \"ipam\" is required and needs a \"type\" (for example {\"type\": \"spiderpool\"})")
	}
	return c, nil
}

func decode(stdin []byte) (*NetConf, *raw, error) {
	c := &NetConf{}
	if err := json.Unmarshal(stdin, &c.NetConf); err != nil {
		return nil, nil, cniutil.InvalidConfigf("failed to parse network configuration: %v: want a JSON object", err)
	}
	r := &raw{}
	if err := json.Unmarshal(stdin, r); err != nil {
		return nil, nil, cniutil.InvalidConfigf("failed to parse network configuration: %v: want a JSON object", err)
	}
	for _, f := range []struct {
		name string
		m    *json.RawMessage
		dst  any
		want string
	}{
		{"master", r.Master, &c.Master, "an interface name string"},
		{"mtu", r.MTU, &c.MTU, "an integer"},
		{"linkInContainer", r.LinkInContainer, &c.LinkInContainer, "true or false"},
		{"validateIaasNetConfig", r.ValidateIaasNetConfig, &c.ValidateIaasNetConfig, "true or false"},
		{"validationRetries", r.ValidationRetries, &c.ValidationRetries, "an integer"},
		{"validationTimeoutMs", r.ValidationTimeoutMs, &c.ValidationTimeoutMs, "an integer (milliseconds)"},
		{"spiderpoolSocket", r.SpiderpoolSocket, &c.SpiderpoolSocket, "a unix socket path string"},
		{"endpointTimeoutMs", r.EndpointTimeoutMs, &c.EndpointTimeoutMs, "an integer (milliseconds)"},
		{"stateDir", r.StateDir, &c.StateDir, "a directory path string"},
		{"ipam", r.IPAM, &c.IPAMConf, "an object with a \"type\""},
	} {
		if err := field(f.name, f.m, f.dst, f.want); err != nil {
			return nil, nil, err
		}
	}
	if r.ValidationRetries == nil {
		c.ValidationRetries = DefaultValidationRetries
	}
	if r.ValidationTimeoutMs == nil {
		c.ValidationTimeoutMs = DefaultValidationTimeoutMs
	}
	if r.EndpointTimeoutMs == nil {
		c.EndpointTimeoutMs = DefaultEndpointTimeoutMs
	}
	if c.SpiderpoolSocket == "" {
		c.SpiderpoolSocket = c.IPAMConf.SocketPath
	}
	if c.SpiderpoolSocket == "" {
		c.SpiderpoolSocket = DefaultSpiderpoolSocket
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	return c, r, nil
}
