package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

// GNUTime is the path of GNU time (Debian package time, `make deps`).
const GNUTime = "/usr/bin/time"

// RSSExec executes plugins as libcni's RawExec does: os/exec, the netconf
// on stdin, stdout and stderr captured through pipes, and Run waits for
// the process to exit and for its stdout and stderr to close. It adds up
// the plugins' CPU time (CPU).
//
// With MeasureRSS set, each plugin runs under GNU time, which forks it from
// its own small process and records its peak resident set size (wait4's
// maxrss; the kernel folds in the peak of the plugin's own waited-for
// children, such as an IPAM delegate). wait4 on a child exec'd from this
// process cannot give it: Go starts children with vfork, and exec records
// the parent's (the test binary's) peak into the child's maxrss.
type RSSExec struct {
	invoke.DefaultExec
	// MeasureRSS runs plugins under GNU time and records their peak RSS.
	MeasureRSS bool

	mu     sync.Mutex
	maxRSS []int64
	cpu    time.Duration
}

// NewRSSExec returns an RSSExec with libcni's plugin lookup and VERSION
// decoding.
func NewRSSExec() *RSSExec {
	return &RSSExec{DefaultExec: invoke.DefaultExec{RawExec: &invoke.RawExec{}, PluginDecoder: version.PluginDecoder{}}}
}

// ExecPlugin runs the plugin at pluginPath with stdinData and environ.
func (e *RSSExec) ExecPlugin(ctx context.Context, pluginPath string, stdinData []byte, environ []string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	c := exec.CommandContext(ctx, pluginPath)
	var rssFile string
	if e.MeasureRSS {
		d, err := os.MkdirTemp("", "aether-rss-")
		if err != nil {
			return nil, err
		}
		defer func() { _ = os.RemoveAll(d) }()
		rssFile = filepath.Join(d, "maxrss")
		c = exec.CommandContext(ctx, GNUTime, "-f", "%M", "-o", rssFile, pluginPath)
	}
	c.Env = environ
	c.Stdin = bytes.NewReader(stdinData)
	c.Stdout, c.Stderr = &stdout, &stderr
	err := c.Run()
	if c.ProcessState != nil {
		e.mu.Lock()
		e.cpu += c.ProcessState.UserTime() + c.ProcessState.SystemTime()
		e.mu.Unlock()
	}
	if rssFile != "" {
		if rerr := e.record(rssFile); rerr != nil && err == nil {
			return nil, rerr
		}
	}
	if err != nil {
		// The plugin's CNI error object, decoded as RawExec does.
		te := &types.Error{Msg: fmt.Sprintf("netplugin failed: %q: %v", stderr.String(), err)}
		if stdout.Len() > 0 {
			if jerr := json.Unmarshal(stdout.Bytes(), te); jerr != nil {
				te.Msg = fmt.Sprintf("netplugin failed but error parsing its diagnostic message %q: %v", stdout.String(), jerr)
			}
		}
		return nil, te
	}
	return stdout.Bytes(), nil
}

// record reads GNU time's %M (KiB) from path.
func (e *RSSExec) record(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("failed to read peak RSS %q: %w", path, err)
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return fmt.Errorf("failed to parse peak RSS %q: empty", path)
	}
	kib, err := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err != nil {
		return fmt.Errorf("failed to parse peak RSS %q: %w", path, err)
	}
	e.mu.Lock()
	e.maxRSS = append(e.maxRSS, kib*1024)
	e.mu.Unlock()
	return nil
}

// CPU returns the CPU time (user + system, from wait4; with the plugins'
// waited-for children, such as an IPAM delegate) of the plugin processes
// run since the last call, and forgets it. Under GNU time (MeasureRSS) it
// includes GNU time's own.
func (e *RSSExec) CPU() time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	d := e.cpu
	e.cpu = 0
	return d
}

// PeakRSS returns the largest peak RSS (bytes) of the plugin processes run
// with MeasureRSS since the last call, and forgets them.
func (e *RSSExec) PeakRSS() int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	var m int64
	for _, v := range e.maxRSS {
		m = max(m, v)
	}
	e.maxRSS = e.maxRSS[:0]
	return m
}
