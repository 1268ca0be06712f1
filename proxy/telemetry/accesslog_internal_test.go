package telemetry

import (
	"bytes"
	"errors"
	"flag"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"aether.io/node/proxy/peers"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// TestAccessLogGolden pins the access log's lines byte for byte (slog's
// time key left out, the connections' times fixed): the open line, a clean
// close over mutual TLS, refusals by policy and by a limit, a misdirected
// connection without a source address, a dry-run, and an error text that
// needs escaping.
func TestAccessLogGolden(t *testing.T) {
	var buf bytes.Buffer
	al, err := NewAccessLog(&buf, AccessLogAll, 1, true)
	if err != nil {
		t.Fatal(err)
	}
	al.log = slog.New(slog.NewJSONHandler(al.out, &slog.HandlerOptions{ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
		if len(groups) == 0 && a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	web := peers.Peer{Workload: "web", Name: "web-7c9f-x2", Namespace: "a", Identity: "spiffe://cluster.local/ns/a/sa/web"}
	db := peers.Peer{Workload: "db", Name: "db-0", Namespace: "b", Identity: "spiffe://cluster.local/ns/b/sa/db"}
	mtls := ConnInfo{
		Reporter: ReporterSource, Src: netip.MustParseAddrPort("10.0.0.5:40000"), Dst: netip.MustParseAddrPort("[fd00::6]:5432"),
		Source: web, Destination: db, SourcePrincipal: web.Identity, DestinationPrincipal: db.Identity,
		Service: peers.ServiceRef{Name: "db", Namespace: "b", Hostname: "db.b.svc.cluster.local"}, MTLS: true, Path: PathHBONE,
	}
	strict := ConnInfo{
		Reporter: ReporterDestination, Src: netip.MustParseAddrPort("10.0.0.5:40001"), Dst: netip.MustParseAddrPort("10.0.0.6:5432"),
		Source: web, Destination: db, SourcePrincipal: web.Identity, Path: PathPlaintext, Policy: PolicyInboundStrict,
	}
	allowed := mtls
	allowed.Reporter, allowed.PolicyDecision, allowed.Policy, allowed.PolicyReason, allowed.PolicyDryRun = ReporterDestination, PolicyAllow, "b/allow-web", "allowed", "b/audit"
	limit := ConnInfo{Reporter: ReporterSource, Src: netip.MustParseAddrPort("10.0.0.5:40002"), Dst: netip.MustParseAddrPort("10.0.0.9:80"), Source: web, Path: PathPassthrough, Limit: LimitPodConnections}
	loop := ConnInfo{Reporter: ReporterDestination, Dst: netip.MustParseAddrPort("10.0.0.6:15006"), Destination: db}
	start := time.Date(2026, 11, 30, 10, 0, 0, 123456789, time.FixedZone("CET", 3600))
	end := start.Add(1234567 * time.Microsecond)
	al.opened(&mtls, start)
	al.write(&mtls, start, end, 100, 7, ReasonServerClosed, nil)
	al.write(&strict, start, start, 0, 0, ReasonDenied, errors.New("plaintext refused"))
	al.write(&allowed, start, end, 5, 0, ReasonReset, errors.New(`read: "connection <reset> & gone"`+"\n"))
	al.write(&limit, start, start, 0, 0, ReasonLimit, errors.New("pod_connections limit"))
	al.write(&loop, start, start, 0, 0, ReasonMisdirected, errors.New("loop"))
	al.Flush()
	golden := filepath.Join("testdata", "accesslog.golden")
	if *update {
		if err := os.WriteFile(golden, buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf.Bytes(), want) {
		t.Errorf("access log lines differ from %s:\n got: %s\nwant: %s", golden, buf.Bytes(), want)
	}
}
