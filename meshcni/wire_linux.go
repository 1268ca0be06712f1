package meshcni

import (
	"os"
	"time"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/meshcni/capture"
	"aether.io/node/meshcni/pin"
	"aether.io/node/meshcni/podpid"
	"aether.io/node/meshcni/readiness"
)

// New returns the plugin wired to the real agent, kernel, runtime and
// filesystem; started is when main began.
func New(started time.Time) *Plugin {
	return &Plugin{
		Started:   started,
		Now:       time.Now,
		DialAgent: DialAgent,
		Capture:   capture.Installer{},
		Pins:      pin.Pins{},
		Readiness: readiness.Prober{},
		PIDs:      podpid.CRI{Timeout: DefaultCRITimeout},
		Stdout:    os.Stdout,
		Stderr:    os.Stderr,
	}
}

// DialAgent returns a gRPC client of the agent named by cfg.
func DialAgent(cfg *Config) (Agent, error) {
	return agentclient.New(cfg.AgentSocket, agentclient.Options{
		Timeout:       cfg.AgentTimeout,
		Attempts:      cfg.AddAttempts,
		Backoff:       100 * time.Millisecond,
		ReportTimeout: DefaultReportTimeout,
	})
}
