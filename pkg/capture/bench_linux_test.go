package capture_test

import (
	"bytes"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/test/harness"
)

// BenchmarkCaptureInstall compares installing our divert in a fresh pod
// netns (one nftables netlink batch plus the IPv4/IPv6 fwmark rules and
// local routes over netlink) with the peer: exec of `nft -f` with an
// Istio-sized in-pod ruleset in a fresh pod netns (nftables only). Namespace
// creation is outside the measurement.
func BenchmarkCaptureInstall(b *testing.B) {
	harness.RequireRoot(b)
	rs := capture.Build(capture.Config{
		RedirectAll: true, ExcludePorts: []uint16{22, 3306},
	})
	run := func(b *testing.B, install func(ns *harness.FdNS) error) {
		runPrepared(b, nil, install)
	}
	b.Run("ours", func(b *testing.B) {
		runOurs(b, nil, rs, nil)
	})
	// With the inbound redirect (the peer's ruleset redirects inbound
	// plaintext too): one more chain and a dozen rules in the same batch.
	inbound := capture.Build(capture.Config{
		RedirectAll: true, ExcludePorts: []uint16{22, 3306}, InboundCapture: true,
		InboundAllowCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.1/32")},
	})
	b.Run("ours_inbound", func(b *testing.B) {
		runOurs(b, nil, inbound, nil)
	})
	// A retried ADD (issue: replacing must cost no more than a fresh
	// install): the namespace already holds the divert of the first attempt,
	// the same one or one of another configuration: one with an exclusion
	// fewer (the retry inserts a rule) or one more (the retry removes one,
	// and the release of the nftables socket then waits for an RCU grace
	// period: see meshcni/README.md).
	other := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22}})
	more := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22, 3306, 5432}})
	b.Run("ours_retry_same", func(b *testing.B) { runOurs(b, &rs, rs, nil) })
	b.Run("ours_retry_changed", func(b *testing.B) { runOurs(b, &other, rs, nil) })
	b.Run("ours_retry_removing", func(b *testing.B) { runOurs(b, &more, rs, nil) })
	// The same retry after a commit by someone else in the namespace (here
	// another table added): no stamp is current, so the retry decodes the
	// table's rules and compares them expression by expression.
	b.Run("ours_retry_removing_touched", func(b *testing.B) {
		runOurs(b, &more, rs, func(ns *harness.FdNS) error {
			c, err := nftables.New(nftables.WithNetNSFd(ns.Fd))
			if err != nil {
				return err
			}
			c.AddTable(&nftables.Table{Name: "other", Family: nftables.TableFamilyINet})
			return c.Flush()
		})
	})
	// The same retry where no closer takes the socket (an architecture
	// without a closer image, or one that failed to start): the grace
	// period is paid in the install's own socket close.
	b.Run("ours_retry_removing_no_closer", func(b *testing.B) {
		runPrepared(b, func(ns *harness.FdNS) error { return capture.Installer{}.InstallFd(ns.Fd, more) },
			func(ns *harness.FdNS) error { return capture.Installer{}.InstallFd(ns.Fd, rs) })
	})
	b.Run("peer", func(b *testing.B) {
		if _, err := exec.LookPath("nft"); err != nil {
			b.Fatalf("peer needs the nft binary: %v", err)
		}
		run(b, func(ns *harness.FdNS) error {
			return ns.Do(func() error {
				cmd := exec.Command("nft", "-f", "-")
				cmd.Stdin = strings.NewReader(capturetest.IstioInPodRuleset)
				var stderr bytes.Buffer
				cmd.Stderr = &stderr
				if err := cmd.Run(); err != nil {
					return &execErr{err: err, stderr: stderr.String()}
				}
				return nil
			})
		})
	})
}

// runOurs measures our install of r in a fresh namespace per op (holding
// first, when set, as a first attempt left it, then whatever also, when
// set, did there), as the plugin installs it:
// with a socket closer of its own per op, started only by a commit that
// removes anything. The measurement is the whole Install, its netfilter
// sockets' close included (in this process: a closer takes the socket of a
// removing commit, and its exit, which pays the grace period, is not
// waited for, as the runtime does not wait for it after the plugin exits);
// the closer is then ended and reaped outside the measurement.
func runOurs(b *testing.B, first *capture.Ruleset, r capture.Ruleset, also func(ns *harness.FdNS) error) {
	var prepare func(ns *harness.FdNS) error
	if first != nil {
		prepare = func(ns *harness.FdNS) error {
			if err := (capture.Installer{}).InstallFd(ns.Fd, *first); err != nil || also == nil {
				return err
			}
			return also(ns)
		}
	}
	var cl *capturetest.Closer
	runPreparedEach(b, prepare, func(ns *harness.FdNS) error {
		cl = capturetest.NewCloser(0)
		return capture.Installer{Closer: cl}.InstallFd(ns.Fd, r)
	}, func() { cl.End(b) })
}

// runPrepared measures install in a fresh namespace per op; prepare (if
// set) runs first, outside the measurement.
func runPrepared(b *testing.B, prepare, install func(ns *harness.FdNS) error) {
	runPreparedEach(b, prepare, install, nil)
}

// runPreparedEach is runPrepared with after (if set) run after each op,
// outside the measurement.
func runPreparedEach(b *testing.B, prepare, install func(ns *harness.FdNS) error, after func()) {
	var lat capturetest.Latencies
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		ns, err := harness.CreateFdNS()
		if err != nil {
			b.Fatal(err)
		}
		if prepare != nil {
			if err := prepare(ns); err != nil {
				ns.Close()
				b.Fatal(err)
			}
		}
		b.StartTimer()
		start := time.Now()
		err = install(ns)
		lat = append(lat, time.Since(start))
		b.StopTimer()
		if after != nil {
			after()
		}
		ns.Close()
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	lat.Report(b)
}

type execErr struct {
	err    error
	stderr string
}

func (e *execErr) Error() string { return e.err.Error() + ": " + e.stderr }
