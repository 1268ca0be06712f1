package hbone_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/pkg/filelock"
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/test/harness"
)

// h2specModule is the tool module pinning h2spec and its dependencies
// (go.mod, go.sum); the binary is built from it once per machine and pin.
const h2specModule = "testdata/h2spec"

// h2specExcluded lists the h2spec cases (ids as h2spec numbers them: suite,
// section, position) that a CONNECT-only server cannot pass, each with the
// request semantics it depends on. Every other case must pass. An excluded
// case that passes is logged, so the table can shrink.
//
// h2spec sends every request as a GET (POST for a body) for "/". The engine
// serves only CONNECT: it answers any other method at once, from its read
// loop, with 405 and END_STREAM and no body, and resets the request side
// (RST_STREAM NO_ERROR) when the client had not ended it. So a request stream
// is closed before the frames a case sends after its HEADERS arrive. The
// cases below need a response body or a request stream that stays open while
// the server handles it. TestH2SpecExcludedWithConnect runs each of them
// (but the content-length ones, which have no CONNECT counterpart) with a
// CONNECT stream instead.
var h2specExcluded = map[string]string{
	"generic/2/2":     "needs a response body: expects a DATA frame of the GET's response after a WINDOW_UPDATE on the half-closed (remote) stream; the 405 has none",
	"generic/2/3":     "needs a response body: expects a DATA frame of the GET's response after a PRIORITY on the half-closed (remote) stream; the 405 has none",
	"http2/5.1.2/1":   "needs request streams that stay open: relies on response bodies held by a zero window to keep 101 GETs open; each 405 ends its stream, so the limit is never reached",
	"http2/6.5.3/1":   "needs a response body (h2spec skips the case when the GET's response has no DATA)",
	"http2/6.9.1/1":   "needs a response body (h2spec skips the case when the GET's response has no DATA)",
	"http2/6.9.1/3":   "needs a request stream that stays open: the GET without END_STREAM is answered 405 and reset (NO_ERROR) before its WINDOW_UPDATEs, which then fall on a closed stream",
	"http2/6.9.2/1":   "needs a response body (h2spec skips the case when the GET's response has no DATA)",
	"http2/6.9.2/2":   "needs a response body (h2spec skips the case when the GET's response has no DATA)",
	"http2/8.1.2.6/1": "needs a request body the server reads: the POST is answered 405 and reset from its HEADERS, before the DATA whose length contradicts content-length arrives",
	"http2/8.1.2.6/2": "needs a request body the server reads: the POST is answered 405 and reset from its HEADERS, before the DATA whose lengths contradict content-length arrive",
}

// TestH2Spec runs h2spec (generic, http2 and hpack suites) against the
// engine that serves 15008: a hbone.Server on a loopback listener, with its
// own TLS config (TLS 1.3, ALPN h2, the server's SVID) except that a client
// without a certificate may finish the handshake, since h2spec cannot
// present one (README.md, "Conformance").
func TestH2Spec(t *testing.T) {
	bin := buildH2Spec(t)
	addr := serveH2SpecTarget(t)

	report := filepath.Join(t.TempDir(), "h2spec.xml")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-t", "-k", "-h", addr.Addr().String(), "-p", strconv.Itoa(int(addr.Port())),
		"-S", "-o", "2", "-j", report, "generic", "http2", "hpack")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("h2spec did not finish within its 5 min bound: %v\n%s", ctx.Err(), out.String())
	}
	// h2spec exits 1 when a case fails: the report decides.
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("failed to run h2spec %q: %v\n%s", bin, err, out.String())
	}
	cases, err := readH2SpecReport(report)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if len(cases) == 0 {
		t.Fatalf("h2spec ran no case\n%s", out.String())
	}
	var passed, failed, excluded int
	for _, c := range cases {
		reason, skip := h2specExcluded[c.id]
		switch {
		case c.failure == "" && skip:
			t.Logf("excluded h2spec case %s (%s) passes now: remove it from h2specExcluded", c.id, c.desc)
			passed++
		case c.failure == "":
			passed++
		case skip:
			excluded++
			t.Logf("excluded %s (%s): %s", c.id, c.desc, reason)
		default:
			failed++
			t.Errorf("h2spec %s: %s\n%s", c.id, c.desc, c.failure)
		}
	}
	t.Logf("h2spec: %d cases, %d passed, %d failed, %d excluded", len(cases), passed, failed, excluded)
	if failed > 0 {
		t.Logf("h2spec output:\n%s", out.String())
	}
}

// serveH2SpecTarget serves a hbone.Server on loopback whose Deliver dials
// the given target (an echo server), checks that a verified client's
// CONNECT is delivered and that a GET is answered 405, and returns the
// server's address. It is shut down when the test ends.
func serveH2SpecTarget(t *testing.T) netip.AddrPort {
	t.Helper()
	ca, err := hbonetest.NewCA(td)
	if err != nil {
		t.Fatal(err)
	}
	certs := hbonetest.NewCerts(ca.Bundle())
	for _, id := range []spiffeid.ID{serverID, clientID} {
		svid, err := ca.ValidSVID(id)
		if err != nil {
			t.Fatal(err)
		}
		certs.SetSVID(svid)
	}
	echo := hbonetest.Echo(t)
	srv, err := hbone.NewServer(hbone.ServerConfig{
		Identity: serverID,
		Certs:    certs,
		Deliver: func(ctx context.Context, _ spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", target.String())
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	hbone.AcceptClientsWithoutCert(srv)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("failed to shut down hbone server: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("failed to serve hbone: %v", err)
		}
	})
	addr := l.Addr().(*net.TCPAddr).AddrPort()

	// A verified client's CONNECT is delivered and echoed.
	d := hbonetest.NewDialer(t, certs)
	s, err := d.Dial(context.Background(), hbone.Request{Source: clientID, Proxy: addr, Target: echo})
	if err != nil {
		t.Fatalf("failed to dial the h2spec target: %v", err)
	}
	roundTrip(t, s, []byte("conformance"))
	_ = s.Close()

	// What h2spec sends, a GET from a client without a certificate, is
	// answered 405 without a body: CONNECT is the only method served.
	tr := &http.Transport{
		ForceAttemptHTTP2: true,
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13}, //nolint:gosec // the server's SVID is not what this checks
	}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+addr.String()+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatalf("failed to send a GET to the h2spec target: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusMethodNotAllowed || len(body) != 0 || resp.ProtoMajor != 2 {
		t.Fatalf("GET answered %d over HTTP/%d with %d body bytes (%v), want 405 over HTTP/2 without a body", resp.StatusCode, resp.ProtoMajor, len(body), err)
	}
	return addr
}

// buildH2Spec returns the h2spec binary of the tool module, building it
// into the per-machine cache when missing (key: h2spec's version and a hash
// of the module's pins).
func buildH2Spec(t *testing.T) string {
	t.Helper()
	mod, err := filepath.Abs(h2specModule)
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(mod, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	gosum, err := os.ReadFile(filepath.Join(mod, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	version, err := requiredVersion(gomod, "github.com/summerwind/h2spec")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(append(gomod, gosum...))
	dir := filepath.Join(harness.CacheDir(), "tools", "h2spec-"+version+"-"+hex.EncodeToString(sum[:6]))
	bin := filepath.Join(dir, "h2spec")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	unlock, err := filelock.Lock(filepath.Join(dir, ".lock"), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if _, err := os.Stat(bin); err == nil {
		return bin // built while we waited for the lock
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tmp := bin + ".tmp"
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", tmp, "tool")
	cmd.Dir = mod
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=-mod=readonly -buildvcs=false")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("failed to build h2spec %s from %q: %v\n%s", version, mod, err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// requiredVersion returns the version go.mod requires of module path.
func requiredVersion(gomod []byte, path string) (string, error) {
	sc := bufio.NewScanner(bytes.NewReader(gomod))
	for sc.Scan() {
		f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(sc.Text()), "require "))
		if len(f) >= 2 && f[0] == path {
			return f[1], nil
		}
	}
	return "", fmt.Errorf("failed to find module %q in the h2spec tool's go.mod", path)
}

// h2specCase is one case of an h2spec JUnit report.
type h2specCase struct {
	id      string // suite/section/position, as h2spec numbers it
	desc    string
	failure string // empty when it passed
}

// readH2SpecReport reads the cases of an h2spec JUnit report. h2spec writes
// one testsuite per section (package = "suite/section") holding its cases
// in order; a case's position there is its number.
func readH2SpecReport(path string) ([]h2specCase, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("failed to read h2spec report %q: %w", path, err)
	}
	var report struct {
		Suites []struct {
			Package string `xml:"package,attr"`
			Cases   []struct {
				ClassName string    `xml:"classname,attr"`
				Failure   *xmlInner `xml:"failure"`
				Error     *xmlInner `xml:"error"`
				Skipped   *xmlInner `xml:"skipped"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(b, &report); err != nil {
		return nil, fmt.Errorf("failed to parse h2spec report %q: %w", path, err)
	}
	var cases []h2specCase
	for _, s := range report.Suites {
		for i, c := range s.Cases {
			hc := h2specCase{id: fmt.Sprintf("%s/%d", s.Package, i+1), desc: c.ClassName}
			switch {
			case c.Failure != nil:
				hc.failure = c.Failure.Text
			case c.Error != nil:
				hc.failure = c.Error.Text
			case c.Skipped != nil:
				hc.failure = "skipped by h2spec"
			}
			cases = append(cases, hc)
		}
	}
	return cases, nil
}

type xmlInner struct {
	Text string `xml:",innerxml"`
}
