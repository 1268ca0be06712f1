package kubernetes_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/pkg/meshcontract"
)

// hbonePort is the port of every managed pod's HBONE listener.
var hbonePort = uint16(meshcontract.HBONEPort)

// untilAnswered connects to addr from the client until every name in want
// answered (60 s bound; failures before the first answer are the push
// still on its way, after it they fail the test) and returns how many
// connections each name answered.
func untilAnswered(t *testing.T, apps *laneApps, addr string, want []string) map[string]int {
	t.Helper()
	got := map[string]int{}
	answered := false
	start := time.Now()
	for {
		name, err := who(apps.clientNS, addr)
		switch {
		case err == nil:
			answered = true
			got[name]++
		case answered:
			t.Fatalf("client -> %s failed after it had answered: %v (answers %v)", addr, err, got)
		case time.Since(start) > 60*time.Second:
			t.Fatalf("client -> %s: %v", addr, err)
		default:
			time.Sleep(200 * time.Millisecond)
			continue
		}
		all := true
		for _, w := range want {
			all = all && got[w] > 0
		}
		if all {
			return got
		}
		if time.Since(start) > 60*time.Second {
			t.Fatalf("client -> %s: answers %v after %s, want every one of %v", addr, got, time.Since(start).Round(time.Millisecond), want)
		}
	}
}

// testCrossNodeService: the client on node A reaches the backend Service,
// answered by the backends on both nodes; each backend's proxy counts a
// mutual-TLS inbound connection from the client's verified principal; the
// fabric carried only TLS to :15008 for it.
func testCrossNodeService(t *testing.T, tn *twoNodes, apps *laneApps) {
	capture := startCapture(t, tn.fabric, laneNodes[0].fabricLink)
	backends := runningPodsIn(t, tn.cluster, tn.nodes[0].kubelet, serverNamespace, "backend", 2, 10*time.Second)
	start := time.Now()
	got := untilAnswered(t, apps, apps.backendVIP, podNames(backends))
	t.Logf("client -> Service backend (%s): answers %v, both nodes within %s", apps.backendVIP, got, time.Since(start).Round(time.Millisecond))
	conns, _, err := onlyTLSTo(capture.Stop(), hbonePort, []byte(laneLine[:len(laneLine)-1]))
	if err != nil {
		t.Fatalf("the fabric carried more than TLS to :%d: %v", hbonePort, err)
	}
	if conns == 0 {
		t.Fatalf("no connection to :%d crossed the fabric, though the backend on %s answered", hbonePort, tn.nodes[1].name)
	}
	t.Logf("fabric capture: %d connection(s), every byte in TLS records to or from :%d", conns, hbonePort)
	for _, n := range tn.nodes {
		m := tn.proxyMetrics(t, n)
		line := metricLine(m, "istio_tcp_connections_opened_total", `reporter="destination"`, `connection_security_policy="mutual_tls"`,
			`source_principal="`+clientPrincipal+`"`, `destination_workload="backend"`)
		if line == "" {
			t.Fatalf("%s's proxy counted no mutual-TLS connection from %s to backend:\n%s", n.name, clientPrincipal, m)
		}
		t.Logf("%s: %s", n.name, line)
	}
	if line := metricLine(tn.proxyMetrics(t, tn.nodes[0]), "aether_outbound_connections_total", `path="service_hbone"`); line == "" {
		t.Fatal("the client's proxy counted no service_hbone connection")
	}
}

// testPodIPHBONE: the client dials the backend pod on node B by its pod
// IP; with the default registry node A's proxy knows that pod, so the
// connection is HBONE (only TLS to :15008 on the fabric), verified by node
// B's proxy.
func testPodIPHBONE(t *testing.T, tn *twoNodes, apps *laneApps) {
	var remote corev1.Pod
	for _, p := range runningPodsIn(t, tn.cluster, tn.nodes[0].kubelet, serverNamespace, "backend", 2, 10*time.Second) {
		if p.Spec.NodeName == tn.nodes[1].name {
			remote = p
		}
	}
	b := tn.nodes[1]
	label := []string{`reporter="destination"`, `connection_security_policy="mutual_tls"`, `source_principal="` + clientPrincipal + `"`, `destination_workload="backend"`}
	before := metricValue(tn.proxyMetrics(t, b), "istio_tcp_connections_opened_total", label...)
	beforeOut := metricValue(tn.proxyMetrics(t, tn.nodes[0]), "aether_outbound_connections_total", `path="hbone"`)
	capture := startCapture(t, tn.fabric, laneNodes[0].fabricLink)
	addr := net.JoinHostPort(remote.Status.PodIP, strconv.Itoa(echoPort))
	name, err := who(apps.clientNS, addr)
	if err != nil || name != remote.Name {
		t.Fatalf("client -> %s (%s on %s): answered %q, %v", addr, remote.Name, b.name, name, err)
	}
	// The proxies may reuse the HBONE connection of the Service scenario
	// (no new handshake): data segments, all to or from :15008, none in
	// the clear.
	conns, data, err := onlyTLSTo(capture.Stop(), hbonePort, []byte(laneLine[:len(laneLine)-1]))
	if err != nil || data == 0 {
		t.Fatalf("pod-IP traffic across the fabric: %d data segment(s) to or from :%d, %v", data, hbonePort, err)
	}
	if after := metricValue(tn.proxyMetrics(t, b), "istio_tcp_connections_opened_total", label...); after < before+1 {
		t.Fatalf("%s's proxy counted %v -> %v mutual-TLS connections from %s, want one more", b.name, before, after, clientPrincipal)
	}
	if after := metricValue(tn.proxyMetrics(t, tn.nodes[0]), "aether_outbound_connections_total", `path="hbone"`); after < beforeOut+1 {
		t.Fatalf("the client's proxy counted %v -> %v hbone connections, want one more", beforeOut, after)
	}
	t.Logf("client -> %s on %s by pod IP: HBONE, %d data segment(s) on the fabric (%d new connection(s)), all to or from :%d, none in the clear", remote.Name, b.name, data, conns, hbonePort)
}

// testUnmanagedBackends: a Service whose only endpoint is an unmanaged pod
// (on node B) answers in plaintext (the client's proxy counts
// service_plaintext; the fabric carries the application's bytes to the
// pod's own port).
func testUnmanagedBackends(t *testing.T, tn *twoNodes, apps *laneApps) {
	plain := runningPodsIn(t, tn.cluster, tn.nodes[0].kubelet, appNamespace, "plainsrv", 1, 10*time.Second)[0]
	before := metricValue(tn.proxyMetrics(t, tn.nodes[0]), "aether_outbound_connections_total", `path="service_plaintext"`)
	capture := startCapture(t, tn.fabric, laneNodes[0].fabricLink)
	untilAnswered(t, apps, apps.plainVIP, []string{plain.Name})
	segs := capture.Stop()
	if after := metricValue(tn.proxyMetrics(t, tn.nodes[0]), "aether_outbound_connections_total", `path="service_plaintext"`); after < before+1 {
		t.Fatalf("the client's proxy counted %v -> %v service_plaintext connections, want more", before, after)
	}
	dst := net.JoinHostPort(plain.Status.PodIP, strconv.Itoa(echoPort))
	clear := slices.ContainsFunc(segs, func(s segment) bool {
		return s.dst.String() == dst && string(s.payload) == laneLine
	})
	if !clear {
		t.Fatalf("no plaintext segment to %s on the fabric (%d pod segments captured)", dst, len(segs))
	}
	t.Logf("client -> Service plainsrv (%s): answered by %s in plaintext to %s", apps.plainVIP, plain.Name, dst)
}

// testNoEndpoints: a Service with no endpoint is refused at once (a reset
// by the client's proxy, counted as service_no_endpoint), never left to
// time out.
func testNoEndpoints(t *testing.T, tn *twoNodes, apps *laneApps) {
	metric := func() float64 {
		return metricValue(tn.proxyMetrics(t, tn.nodes[0]), "aether_outbound_connections_total", `path="service_no_endpoint"`)
	}
	before := metric()
	start := time.Now()
	var (
		err  error
		took time.Duration
	)
	// The Service's push may still be on its way (then the VIP is no
	// workload and the connection passes through to nothing): retry until
	// the proxy counts the refusal.
	for {
		t0 := time.Now()
		_, err = who(apps.clientNS, apps.emptyVIP)
		took = time.Since(t0)
		if err == nil {
			t.Fatalf("client -> Service empty (%s) answered", apps.emptyVIP)
		}
		if metric() > before {
			break
		}
		if time.Since(start) > 30*time.Second {
			t.Fatalf("client -> Service empty (%s): %v, but no service_no_endpoint counted", apps.emptyVIP, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("client -> Service empty: %v, want a reset or a refusal", err)
	}
	if took >= 3*time.Second {
		t.Fatalf("client -> Service empty took %s to fail, want at once (the dial timeout is 3 s)", took)
	}
	t.Logf("client -> Service empty (%s) refused in %s: %v", apps.emptyVIP, took.Round(time.Microsecond), err)
}

// testTerminatingBackend: a deleted backend keeps answering (it lingers
// after SIGTERM), but once the push marked it terminating no new
// connection reaches it, while a steady loop never fails.
func testTerminatingBackend(t *testing.T, tn *twoNodes, apps *laneApps) {
	ctx := context.Background()
	backends := runningPodsIn(t, tn.cluster, tn.nodes[0].kubelet, serverNamespace, "backend", 2, 10*time.Second)
	victim := backends[0]
	if eps := tn.serviceEndpoints(t, tn.nodes[0], serverNamespace, "backend"); !slices.Equal(eps, podNames(backends)) {
		t.Fatalf("before the delete the client's proxy lists %v, want %v", eps, podNames(backends))
	}
	loop := probeLoop(t, apps.clientNS, apps.backendVIP, 50*time.Millisecond)
	if err := tn.cluster.Client.CoreV1().Pods(serverNamespace).Delete(ctx, victim.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	var pushed time.Time
	for {
		if !slices.Contains(tn.serviceEndpoints(t, tn.nodes[0], serverNamespace, "backend"), victim.Name) {
			pushed = time.Now()
			break
		}
		if time.Since(deleted) > 30*time.Second {
			t.Fatalf("the client's proxy still lists %s as a serving endpoint 30 s after its deletion", victim.Name)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(3 * time.Second)
	probes := loop()
	p, err := tn.cluster.Client.CoreV1().Pods(serverNamespace).Get(ctx, victim.Name, metav1.GetOptions{})
	if err != nil || p.DeletionTimestamp == nil || p.Status.Phase != corev1.PodRunning {
		t.Fatalf("%s is not a running, terminating pod at the end of the window (%v): the check proves nothing", victim.Name, err)
	}
	var after, failed int
	for _, pr := range probes {
		switch {
		case pr.at.After(pushed) && pr.err != nil:
			t.Errorf("connection at +%s after the push failed: %v", pr.at.Sub(pushed).Round(time.Millisecond), pr.err)
		case pr.at.After(pushed) && pr.name == victim.Name:
			t.Errorf("connection at +%s after the push reached the terminating %s", pr.at.Sub(pushed).Round(time.Millisecond), victim.Name)
		case pr.err != nil:
			// Between the delete and the push the client may still choose
			// the victim, whose own node deregistered it at once.
			failed++
			t.Logf("connection at +%s after the delete, before the push, failed: %v", pr.at.Sub(deleted).Round(time.Millisecond), pr.err)
		}
		if pr.at.After(pushed) {
			after++
		}
	}
	if failed > 0 {
		for _, n := range tn.nodes {
			m := tn.proxyMetrics(t, n)
			for _, l := range strings.Split(m, "\n") {
				if strings.HasPrefix(l, "aether_outbound_connections_total{") || strings.HasPrefix(l, "aether_inbound_refusals_total{") || strings.HasPrefix(l, "aether_policy_denials_total{") {
					t.Logf("%s: %s", n.name, l)
				}
			}
		}
	}
	if after < 10 {
		t.Fatalf("only %d connections after the push: the check proves nothing", after)
	}
	t.Logf("%s (on %s) deleted: out of the client's endpoints after %s; %d connections, %d after the push (none to it, none failed), %d failed before the push",
		victim.Name, victim.Spec.NodeName, pushed.Sub(deleted).Round(time.Millisecond), len(probes), after, failed)
}

// testScale: the backend Deployment scaled 2 -> 4 -> 1 under a steady
// connection loop: after each step's push (the client's proxy lists
// exactly the running backends), every connection succeeds and reaches
// only those backends.
func testScale(t *testing.T, tn *twoNodes, apps *laneApps) {
	ctx := context.Background()
	runningPodsIn(t, tn.cluster, tn.nodes[0].kubelet, serverNamespace, "backend", 2, 60*time.Second)
	loop := probeLoop(t, apps.clientNS, apps.backendVIP, 50*time.Millisecond)
	type window struct {
		from, to time.Time
		want     []string
	}
	var windows []window
	for _, replicas := range []int32{4, 1} {
		stepStart := time.Now()
		sc, err := tn.cluster.Client.AppsV1().Deployments(serverNamespace).GetScale(ctx, "backend", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sc.Spec.Replicas = replicas
		if _, err := tn.cluster.Client.AppsV1().Deployments(serverNamespace).UpdateScale(ctx, "backend", sc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		want := podNames(runningPodsIn(t, tn.cluster, tn.nodes[0].kubelet, serverNamespace, "backend", int(replicas), 120*time.Second))
		for !slices.Equal(tn.serviceEndpoints(t, tn.nodes[0], serverNamespace, "backend"), want) {
			if time.Since(stepStart) > 60*time.Second {
				t.Fatalf("scaled to %d: the client's proxy lists %v, want %v", replicas, tn.serviceEndpoints(t, tn.nodes[0], serverNamespace, "backend"), want)
			}
			time.Sleep(50 * time.Millisecond)
		}
		pushed := time.Now()
		t.Logf("scaled to %d: pushed %s after the scale (%v)", replicas, pushed.Sub(stepStart).Round(time.Millisecond), want)
		time.Sleep(3 * time.Second)
		windows = append(windows, window{pushed, time.Now(), want})
	}
	probes := loop()
	failedAll := 0
	for _, pr := range probes {
		if pr.err != nil {
			failedAll++
		}
	}
	for _, w := range windows {
		var n int
		seen := map[string]int{}
		for _, pr := range probes {
			if pr.at.Before(w.from) || pr.at.After(w.to) {
				continue
			}
			n++
			if pr.err != nil {
				t.Errorf("with %d backends, connection at %s failed after the push: %v", len(w.want), pr.at.Format(time.StampMilli), pr.err)
				continue
			}
			seen[pr.name]++
			if !slices.Contains(w.want, pr.name) {
				t.Errorf("with %d backends, a connection after the push reached %s, not one of %v", len(w.want), pr.name, w.want)
			}
		}
		if n < 10 {
			t.Fatalf("only %d connections in the window after the push to %d backends", n, len(w.want))
		}
		t.Logf("%d backends: %d connections after the push, answers %v", len(w.want), n, seen)
	}
	t.Logf("whole loop: %d connections, %d failed (in and out of the windows after the pushes)", len(probes), failedAll)
}
