package meshcni

import (
	"os"
	"time"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/meshcni/pin"
	"aether.io/node/meshcni/podpid"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/readiness"
	"aether.io/node/pkg/sockcloser"
)

// New returns the plugin wired to the real agent, kernel, runtime and
// filesystem; started is when main began. The netfilter socket of a divert
// commit that removed anything goes to a socket closer process
// (capture.CloserName, started only for such a commit), so neither the
// install nor the plugin's exit waits for its release.
func New(started time.Time) *Plugin {
	return &Plugin{
		Started:   started,
		Now:       time.Now,
		DialAgent: DialAgent,
		Capture:   capture.Installer{Closer: &sockcloser.ExecCloser{Name: capture.CloserName}},
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
