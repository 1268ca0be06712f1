//go:build linux

// Command aether-proxy is the node data plane: an xDS client of aether-agent
// that binds each mesh-managed pod's listeners inside the pod's network
// namespace, answers aether-cni's readiness probe, forwards captured TCP and
// UDP to the original destination, and exports per-workload telemetry.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/telemetry"
)

func main() {
	var cfg proxy.Config
	host, _ := os.Hostname()
	flag.StringVar(&cfg.XDSTarget, "xds-address", "unix://"+meshcontract.ProxySocketDir+"/"+meshcontract.XDSSocketName, "the agent's xDS endpoint as a gRPC target (unix:///path or host:port)")
	flag.StringVar(&cfg.LDSTarget, "lds-address", "", "optional separate xDS endpoint for the Listener type (default: the same ADS stream as -xds-address)")
	flag.StringVar(&cfg.NodeID, "node-id", host, "node id sent to the agent (the node name)")
	flag.StringVar(&cfg.AdminAddress, "admin-address", "127.0.0.1:18090", "address of /metrics, /healthz and /debug/pods (empty disables)")
	flag.StringVar(&cfg.MetricsAddress, "metrics-address", "", "a second address serving /metrics only (for example the node's, [$(NODE_IP)]:15020, for Prometheus); /healthz and /debug/pods stay on -admin-address; empty disables")
	bypass := flag.Uint("bypass-mark", dataplane.DefaultBypassMark, "SO_MARK of upstream sockets; must equal aether-cni's capture bypass mark")
	deliver := flag.Uint("deliver-mark", dataplane.DefaultDeliverMark, "SO_MARK of inbound delivery sockets bound to the client's address (the app sees the client, not the pod); must equal aether-cni's capture deliver_mark")
	flag.DurationVar(&cfg.Dataplane.ConnectTimeout, "connect-timeout", dataplane.DefaultConnectTimeout, "upstream TCP connect timeout")
	flag.DurationVar(&cfg.Dataplane.DrainTimeout, "drain-timeout", dataplane.DefaultDrainTimeout, "how long a removed pod's open connections may run")
	flag.DurationVar(&cfg.Dataplane.CheckInterval, "netns-check-interval", dataplane.DefaultCheckInterval, "how often pinned netns paths are checked and failed binds retried")
	flag.DurationVar(&cfg.Dataplane.UDPIdleTimeout, "udp-idle-timeout", dataplane.DefaultUDPIdleTimeout, "idle time after which a UDP flow ends")
	flag.DurationVar(&cfg.Dataplane.ShutdownDrain, "shutdown-drain", 20*time.Second, "on SIGTERM: how long established connections may finish after every pod stopped accepting (0 closes at once; keep it under the pod's termination grace period)")
	flag.DurationVar(&cfg.Dataplane.DNSIdleTimeout, "dns-idle-timeout", dataplane.DefaultDNSIdleTimeout, "idle time after which a UDP flow to port 53 ends")
	flag.DurationVar(&cfg.Dataplane.TCPIdleTimeout, "tcp-idle-timeout", dataplane.DefaultTCPIdleTimeout, "a proxied TCP connection with no data either way for this long is closed")
	flag.StringVar(&cfg.Dataplane.UDSRoot, meshcontract.UDSCSIRootFlag, meshcontract.DefaultUDSCSIRoot, "root of the pods' UDS socket dirs (<root>/<pod uid>/, aether-csi's and aether-agent's flag of the same name); inbound delivery connects only to a socket in the pod's own dir there, never through a link")
	flag.IntVar(&cfg.Dataplane.MaxConnsPerPod, "max-connections-per-pod", dataplane.DefaultMaxConnsPerPod, "open TCP connections one pod may have through the proxy; more are reset")
	flag.IntVar(&cfg.Dataplane.MaxConns, "max-connections", dataplane.DefaultMaxConns, "open TCP connections of all pods together; more are reset")
	flag.IntVar(&cfg.Dataplane.MaxUDPFlowsPerPod, "max-udp-flows-per-pod", dataplane.DefaultMaxUDPFlowsPerPod, "open UDP flows of one pod; a new one evicts the pod's least recently used")
	flag.IntVar(&cfg.Dataplane.MaxUDPFlows, "max-udp-flows", dataplane.DefaultMaxUDPFlows, "open UDP flows of all pods together; a new one evicts the same pod's least recently used, or is dropped")
	flag.StringVar(&cfg.WorkloadAPISocket, "workload-api-socket", "", "SPIFFE Workload API socket of the node's workload identities (aether-agent's --workload-api-socket, e.g. "+meshcontract.ProxySocketDir+"/"+meshcontract.WorkloadAPISocketName+"); empty turns identity off")
	flag.StringVar(&cfg.WorkloadAPITokenFile, "workload-api-token", "", "file of the token sent on every Workload API call (aether-agent writes a new one at each start; read again at every reconnect); empty means "+meshcontract.WorkloadAPITokenFile+" next to -workload-api-socket")
	flag.IntVar(&cfg.Dataplane.HBONEMaxConns, "hbone-max-connections", dataplane.DefaultHBONEMaxConns, "inbound HBONE connections (every pod's :15008, handshakes included) of the node; more are closed at accept")
	flag.IntVar(&cfg.Dataplane.HBONEMaxConnsPerSource, "hbone-max-connections-per-source", dataplane.DefaultHBONEMaxConnsPerSource, "inbound HBONE connections of one source address; more are closed at accept")
	windowMiB := flag.Int64("hbone-window-budget-mib", dataplane.DefaultHBONEWindowBudget>>20, "MiB of HTTP/2 receive window HBONE connections may grant beyond 64 KiB each (bounds data queued for readers that do not read), inbound and outbound each")
	windowSrcMiB := flag.Int64("hbone-window-budget-per-source-mib", dataplane.DefaultHBONEWindowBudgetPerSource>>20, "the same per source address (inbound) and per source pod (outbound)")
	flag.IntVar(&cfg.Dataplane.HBONESendBufs, "hbone-send-buffers", dataplane.DefaultHBONESendBufs, "256 KiB send buffers HBONE streams may hold at once while their writes wait for a peer that reads slowly (bounds that memory), inbound and outbound each")
	flag.IntVar(&cfg.Dataplane.HBONESendBufsPerSource, "hbone-send-buffers-per-source", dataplane.DefaultHBONESendBufsPerSource, "the same per source address (inbound) and per source pod (outbound)")
	controlMiB := flag.Int64("hbone-control-budget-mib", dataplane.DefaultHBONEControlBudget>>20, "MiB of HTTP/2 control frames (PING and SETTINGS acks, resets, WINDOW_UPDATEs) HBONE connections may queue for peers that do not read them, beyond 16 KiB each; a connection past it is closed as a control flood; inbound and outbound each")
	controlSrcMiB := flag.Int64("hbone-control-budget-per-source-mib", dataplane.DefaultHBONEControlBudgetPerSource>>20, "the same per source address (inbound) and per source pod (outbound)")
	hbonePort := flag.Uint("hbone-port", dataplane.DefaultHBONEPort, "port of every pod's HBONE listener (with -workload-api-socket)")
	flag.StringVar(&cfg.SPIREAdminSocket, "spire-admin-socket", "", "SPIRE agent admin socket (its admin_socket_path) serving the Delegated Identity API; the proxy must be one of the agent's authorized_delegates; mutually exclusive with -workload-api-socket")
	flag.BoolVar(&cfg.Dataplane.HBONEDeclaredPortsOnly, "hbone-declared-ports-only", false, "deliver an HBONE stream only to a TCP port the destination pod's containers declare (spec.containers[].ports, sidecars included); others are refused with 403 before the app sees a connection. A pod whose ports the agent does not know (its record predates them) gets every port, as without the flag")
	level := flag.String("log-level", "info", "debug, info, warn or error")
	accessLog := flag.String("access-log", telemetry.DefaultAccessLogLevel.String(), "connections written to the access log on stdout, one JSON line each at its close: off, errors (refused, failed, reset, timed out, cut by a drain) or all")
	flag.BoolVar(&cfg.AccessLogOpens, "access-log-open", false, "with -access-log=all, also write a line when a connection opens (\"connection opened\", the same keys)")
	accessRate := flag.Float64("access-log-sample-rate", 1, "share of connections whose access-log lines are kept, 0 to 1 (0: none)")
	flag.StringVar(&cfg.FlowsSocket, "flows-socket", flowapi.DefaultSocket, "unix socket (mode 0600) streaming the node's live connection events to aetherctl flows; its directory must be the proxy's own, never "+meshcontract.ProxySocketDir+" nor one a pod reaches; empty disables")
	flag.StringVar(&cfg.HandoverSocket, "handover-socket", proxy.DefaultHandoverSocket, "unix socket (root only, in the proxy's own run dir) a starting proxy takes the running proxy's listening sockets over on, so an upgrade refuses no connection; empty turns the hand-over off (each proxy binds its own; stop-then-start)")
	flag.DurationVar(&cfg.HandoverTimeout, "handover-timeout", proxy.DefaultHandoverTimeout, "how long a starting proxy may take to sync with the agent before it completes a hand-over; past it, it exits and the running proxy serves on")
	flowsUIDs := flag.String("flows-allowed-uids", "0", "comma-separated peer uids (SO_PEERCRED) allowed to follow -flows-socket")
	flag.Parse()
	var err error
	if cfg.AccessLog, err = telemetry.ParseAccessLogLevel(*accessLog); err != nil {
		fmt.Fprintf(os.Stderr, "aether-proxy: invalid -access-log %q: use off, errors or all\n", *accessLog)
		os.Exit(2)
	}
	if !(*accessRate >= 0 && *accessRate <= 1) {
		fmt.Fprintf(os.Stderr, "aether-proxy: invalid -access-log-sample-rate %v: must be between 0 and 1\n", *accessRate)
		os.Exit(2)
	}
	cfg.AccessLogSampleRate = *accessRate
	if *accessRate == 0 {
		cfg.AccessLog = telemetry.AccessLogOff
	}
	for _, f := range strings.Split(*flowsUIDs, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		u, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			fmt.Fprintf(os.Stderr, "aether-proxy: invalid -flows-allowed-uids entry %q: want a decimal uid\n", f)
			os.Exit(2)
		}
		cfg.FlowsAllowedUIDs = append(cfg.FlowsAllowedUIDs, uint32(u))
	}
	if len(cfg.FlowsAllowedUIDs) == 0 {
		fmt.Fprintln(os.Stderr, "aether-proxy: invalid -flows-allowed-uids: at least one uid is required")
		os.Exit(2)
	}
	cfg.Dataplane.BypassMark = uint32(*bypass)
	cfg.Dataplane.DeliverMark = uint32(*deliver)
	if *hbonePort == 0 || *hbonePort > 65535 {
		fmt.Fprintf(os.Stderr, "aether-proxy: invalid -hbone-port %d: must be 1-65535\n", *hbonePort)
		os.Exit(2)
	}
	cfg.Dataplane.HBONEPort = uint16(*hbonePort)
	for _, w := range []struct {
		name string
		mib  int64
		dst  *int64
	}{
		{"hbone-window-budget-mib", *windowMiB, &cfg.Dataplane.HBONEWindowBudget},
		{"hbone-window-budget-per-source-mib", *windowSrcMiB, &cfg.Dataplane.HBONEWindowBudgetPerSource},
		{"hbone-control-budget-mib", *controlMiB, &cfg.Dataplane.HBONEControlBudget},
		{"hbone-control-budget-per-source-mib", *controlSrcMiB, &cfg.Dataplane.HBONEControlBudgetPerSource},
	} {
		if w.mib < 1 || w.mib > 1<<20 {
			fmt.Fprintf(os.Stderr, "aether-proxy: invalid -%s %d: must be 1-1048576\n", w.name, w.mib)
			os.Exit(2)
		}
		*w.dst = w.mib << 20
	}

	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		fmt.Fprintf(os.Stderr, "aether-proxy: invalid -log-level %q: use debug, info, warn or error\n", *level)
		os.Exit(2)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	p, err := proxy.New(cfg, log)
	if err != nil {
		log.Error("failed to start", "error", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := p.Run(ctx); err != nil {
		log.Error("proxy stopped", "error", err)
		os.Exit(1)
	}
}
