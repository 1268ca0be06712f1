// Package app wires the aether-agent: flags, pod source, store, registry,
// CNI socket, admin socket, metrics and health endpoints, and shutdown.
package app

import (
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/util/validation"

	"aether.io/node/agent/identity"
	"aether.io/node/pkg/enrolment"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/pkg/tlsfiles"
	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	"aether.io/node/xds/resource"
)

// SocketDir is the directory of the agent's private sockets (cni.sock,
// admin.sock), which aether-proxy never mounts; ProxySocketDir holds the
// sockets aether-proxy consumes (xds.sock, lds.sock, workload.sock) and the
// Workload API token. The agent creates each 0700 and serves only from a
// directory closed to group and others; an existing one kubelet made 0755
// (hostPath DirectoryOrCreate) is tightened when it is safe to
// (tightenSocketDir). Their parent (/run/aether, which kubelet and
// aether-cni's pin directory may create 0755) is not checked. Before these
// directories existed the defaults were /run/aether/<name>.sock, then
// /run/aether/agent/<name>.sock for all five.
const (
	SocketDir      = meshcontract.AgentSocketDir
	ProxySocketDir = meshcontract.ProxySocketDir
)

// Config is the agent's configuration (one field per flag).
type Config struct {
	CNISocket        string
	AdminSocket      string
	StateDir         string
	PodManifests     string
	ManifestInterval time.Duration
	Kubeconfig       string
	NodeName         string
	AllowedUIDs      []uint32
	SystemNamespaces []string
	// AmbientNamespaces makes istio.io/dataplane-mode: ambient on a
	// namespace enrol its pods as aether.io/managed: "true" does.
	AmbientNamespaces bool
	UDSRoot           string
	HTTPAddr          string
	// MetricsAddr, when set, serves /metrics (only) on a second address,
	// such as the node's, for a Prometheus outside the node; health stays
	// on HTTPAddr.
	MetricsAddr      string
	LivenessInterval time.Duration
	PodWait          time.Duration
	ShutdownTimeout  time.Duration
	OTLPEndpoint     string
	LogLevel         string
	Locality         registry.Locality
	// GCPercent is the Go GC target percentage the agent runs with (as
	// GOGC; DefaultGCPercent) unless the GOGC environment variable is set.
	GCPercent int
	// RemoveNotReadyTaint removes nodegate.TaintKey from this node's Node
	// once the CNI socket serves and the pod source has synced (Kubernetes
	// pod source only).
	RemoveNotReadyTaint bool
	// XDSSocket and XDSAddress serve workload discovery; LDSSocket serves
	// aether-proxy's per-pod listeners.
	XDSSocket, XDSAddress, LDSSocket string
	// XDSTLS are the mutual-TLS files of --xds-address (required beyond
	// loopback); XDSMaxRecvBytes bounds one request received there.
	XDSTLS          tlsfiles.Files
	XDSMaxRecvBytes int
	// XDSHandshakeTimeout bounds the TLS handshake (and HTTP/2 preface) of
	// a new --xds-address connection; it holds a connection slot until then.
	XDSHandshakeTimeout time.Duration
	// ClusterID, TrustDomain and Network go into every served workload.
	ClusterID, TrustDomain, Network string
	// ClusterDomain is the DNS domain of Service hostnames
	// (<name>.<namespace>.svc.<domain>).
	ClusterDomain string
	// RootNamespace is the mesh's root namespace: its AuthorizationPolicies
	// without a selector apply to every workload (Istio's rootNamespace).
	RootNamespace string
	// Registry is "local", "kube" or "etcd"; the Etcd* fields configure
	// etcd.
	Registry                              string
	EtcdEndpoints                         []string
	EtcdPrefix                            string
	EtcdLeaseTTL                          time.Duration
	EtcdCAFile, EtcdCertFile, EtcdKeyFile string
	// EtcdInsecure allows plaintext etcd (http:// endpoints, or no TLS files).
	EtcdInsecure bool
	// CACertFile and CAKeyFile are the PEM signing CA of the embedded SPIFFE
	// provider; both empty turns identity off.
	CACertFile, CAKeyFile string
	// CA is the parsed and validated CA of CACertFile and CAKeyFile for
	// TrustDomain (ParseFlags loads it); nil when identity is off.
	CA *identity.CA
	// CATrustBundleFile holds extra PEM CA certificates the served trust
	// bundle carries besides CA (the other CA of a rotation); "" = none.
	CATrustBundleFile string
	// CAAnchors are the parsed certificates of CATrustBundleFile.
	CAAnchors []*x509.Certificate
	// CAReloadInterval is how often the CA files are read again; a change
	// is applied without a restart. 0 disables reloading.
	CAReloadInterval time.Duration
	// ExternalIdentities says another provider (SPIRE, through the
	// proxy's -spire-admin-socket) issues the pods' SVIDs: the listeners
	// carry their SPIFFE IDs and WDS marks them HBONE without --ca-cert.
	ExternalIdentities bool
	// SVIDTTL is the lifetime of every minted X.509-SVID; SVIDs rotate at
	// half of it.
	SVIDTTL time.Duration
	// WorkloadAPISocket serves the SPIFFE Workload API when identity is on.
	WorkloadAPISocket string
	// InboundPolicy is the inbound policy of a pod without a valid
	// meshcontract.InboundPolicyAnnotation: permissive or strict.
	InboundPolicy string

	// text is the text of the list and locality flags until Validate
	// parses it.
	text flagText
}

// HBONE reports whether the node's pods have SPIFFE identities (the
// embedded CA or an external provider), so their proxies serve HBONE.
func (c *Config) HBONE() bool { return c.CA != nil || c.ExternalIdentities }

// MinSVIDTTL is the shortest --svid-ttl: X.509 validity has a precision of
// one second, and a rotation needs a lifetime it can halve.
const MinSVIDTTL = 2 * time.Second

// flagText is the text of the flags that ParseFlags turns into a list or
// a locality: Validate parses it, once, into the Config fields.
type flagText struct {
	uids, sysNS, etcdEndpoints, locality string
}

// ParseFlags parses args (without the program name). It returns
// flag.ErrHelp after printing usage for --help. It is the flag
// registration (flagSet), Validate, and the CA's loading.
func ParseFlags(args []string, stderr io.Writer) (*Config, error) {
	c := &Config{}
	fs := c.flagSet(stderr)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q: aether-agent takes flags only", fs.Args())
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if err := c.loadCA(time.Now()); err != nil {
		return nil, err
	}
	return c, nil
}

// flagSet registers the agent's flags, each with its default, into c (and
// c.text for the lists and the locality), output and usage to stderr.
func (c *Config) flagSet(stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("aether-agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	host, _ := os.Hostname()
	defNode := os.Getenv("NODE_NAME")
	if defNode == "" {
		defNode = host
	}
	fs.StringVar(&c.CNISocket, "cni-socket", SocketDir+"/"+meshcontract.CNISocketName, "unix socket serving aether.cni.v1.CNIService (mode 0600; its directory must be 0700)")
	fs.StringVar(&c.AdminSocket, "admin-socket", SocketDir+"/"+meshcontract.AdminSocketName, "unix socket serving the read-only admin API used by aetherctl (mode 0600); empty disables it")
	fs.StringVar(&c.StateDir, "state-dir", "/var/lib/aether", "directory of the durable pod store (agent.log, locked by agent.lock)")
	fs.StringVar(&c.PodManifests, "pod-manifests", "", "directory of Pod manifests (YAML/JSON) to use as the pod source instead of the Kubernetes API")
	fs.DurationVar(&c.ManifestInterval, "pod-manifests-interval", time.Second, "how often --pod-manifests is rescanned (a lookup miss also rescans)")
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig for the Kubernetes pod source; empty means in-cluster config")
	fs.BoolVar(&c.RemoveNotReadyTaint, "remove-not-ready-taint", true, "remove the taint aether.io/agent-not-ready:NoSchedule from this node's Node once the CNI socket serves and the pod source has synced (Kubernetes pod source only; needs patch on nodes)")
	fs.StringVar(&c.NodeName, "node-name", defNode, "this node's name (default $NODE_NAME, else the hostname)")
	fs.StringVar(&c.text.uids, "allowed-uids", "0", "comma-separated peer uids allowed on the CNI and admin sockets")
	fs.StringVar(&c.text.sysNS, "system-namespaces", strings.Join(enrolment.DefaultSystemNamespaces, ","), "comma-separated namespaces that are never mesh-managed, whatever the labels of their pods or their own")
	fs.BoolVar(&c.AmbientNamespaces, "ambient-namespaces", false, "a namespace labelled istio.io/dataplane-mode=ambient enrols its pods as aether.io/managed=true does (Istio ambient's namespace label as an alias)")
	fs.StringVar(&c.UDSRoot, meshcontract.UDSCSIRootFlag, meshcontract.DefaultUDSCSIRoot, "root of the "+meshcontract.CSIDriver+" driver's sockets: <root>/<pod uid>/<file>; must equal aether-csi's")
	fs.StringVar(&c.HTTPAddr, "http-addr", "127.0.0.1:15029", "TCP address of /metrics, /healthz and /readyz; port 0 picks one (logged)")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", "", "a second TCP address serving /metrics only (for example the node's address, [$(NODE_IP)]:15030, for Prometheus); health stays on --http-addr; empty disables")
	fs.DurationVar(&c.LivenessInterval, "liveness-interval", 5*time.Second, "period of the liveness loop")
	fs.DurationVar(&c.PodWait, "pod-wait", 5*time.Second, "longest AddPod waits for an unknown pod when the request has no earlier deadline")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "how long shutdown waits for in-flight RPCs")
	fs.StringVar(&c.OTLPEndpoint, "otlp-endpoint", "", "OTLP/gRPC collector (host:port) for traces; empty disables export")
	fs.StringVar(&c.LogLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.IntVar(&c.GCPercent, "gc-percent", DefaultGCPercent, "Go GC target percentage (as GOGC, at least 1); the GOGC environment variable, when set, takes precedence")
	fs.StringVar(&c.XDSSocket, "xds-socket", ProxySocketDir+"/"+meshcontract.XDSSocketName, "unix socket serving workload discovery ("+resource.WorkloadType+", delta and SotW ADS); empty disables it")
	fs.StringVar(&c.XDSAddress, "xds-address", "", "optional TCP host:port also serving workload discovery; beyond loopback it requires --xds-tls-cert, --xds-tls-key and --xds-client-ca (mutual TLS)")
	fs.StringVar(&c.XDSTLS.Cert, "xds-tls-cert", "", "PEM certificate chain --xds-address presents (reloaded when the file changes)")
	fs.StringVar(&c.XDSTLS.Key, "xds-tls-key", "", "PEM private key of --xds-tls-cert")
	fs.StringVar(&c.XDSTLS.CA, "xds-client-ca", "", "PEM bundle that verifies the client certificates --xds-address requires")
	fs.IntVar(&c.XDSMaxRecvBytes, "xds-max-recv-bytes", DefaultXDSMaxRecvBytes, "largest request --xds-address accepts (a reconnect's initial_resource_versions grows with the cluster; the unix socket has no such limit)")
	fs.DurationVar(&c.XDSHandshakeTimeout, "xds-handshake-timeout", DefaultXDSHandshakeTimeout, "longest TLS handshake (and HTTP/2 preface) of a new --xds-address connection; a slower one is closed and its slot of the "+strconv.Itoa(xdsTCPMaxConns)+" connections freed (at most "+maxXDSHandshakeTimeout.String()+")")
	fs.StringVar(&c.LDSSocket, "lds-socket", ProxySocketDir+"/"+meshcontract.LDSSocketName, "unix socket serving aether-proxy's per-pod listeners (envoy.config.listener.v3.Listener, ADS); empty disables it")
	fs.StringVar(&c.ClusterID, "cluster-id", "Kubernetes", "cluster name: the first segment of every workload uid and its cluster_id")
	fs.StringVar(&c.TrustDomain, "trust-domain", "cluster.local", "SPIFFE trust domain of the workloads")
	fs.StringVar(&c.RootNamespace, "root-namespace", "istio-system", "the mesh's root namespace: an AuthorizationPolicy there without a selector applies to every workload (Istio's meshConfig rootNamespace)")
	fs.StringVar(&c.ClusterDomain, "cluster-domain", "cluster.local", "DNS domain of the cluster's Services: served Service hostnames are <name>.<namespace>.svc.<domain> (kubelet's --cluster-domain)")
	fs.StringVar(&c.Network, "network", "", "network of the pods' addresses; empty for the default network")
	fs.StringVar(&c.Registry, "registry", "local", "endpoint registry: local (embedded, this node only), kube (this node's embedded, every other node's mesh-managed pods from the Kubernetes API) or etcd (spans nodes through etcd)")
	fs.StringVar(&c.text.etcdEndpoints, "etcd-endpoints", "", "comma-separated etcd client URLs for --registry=etcd")
	fs.StringVar(&c.EtcdPrefix, "etcd-prefix", "", "etcd key prefix shared by all agents (default /aether/endpoints/)")
	fs.DurationVar(&c.EtcdLeaseTTL, "etcd-lease-ttl", 10*time.Second, "how long a dead node's endpoints survive in etcd")
	fs.StringVar(&c.EtcdCAFile, "etcd-ca", "", "CA bundle to verify etcd (TLS)")
	fs.StringVar(&c.EtcdCertFile, "etcd-cert", "", "client certificate for etcd (TLS)")
	fs.StringVar(&c.EtcdKeyFile, "etcd-key", "", "client key for etcd (TLS)")
	fs.BoolVar(&c.EtcdInsecure, "etcd-insecure", false, "allow plaintext etcd: http:// endpoints, or none of --etcd-ca, --etcd-cert, --etcd-key (never TLS files with http://)")
	fs.StringVar(&c.CACertFile, "ca-cert", "", "PEM certificate of the CA that signs the pods' X.509-SVIDs (embedded SPIFFE provider); with --ca-key turns identity on")
	fs.StringVar(&c.CAKeyFile, "ca-key", "", "PEM private key (PKCS#8, SEC 1 or PKCS#1) of --ca-cert")
	fs.StringVar(&c.CATrustBundleFile, "ca-trust-bundle", "", "PEM file of extra CA certificates the trust bundle carries besides --ca-cert (the next or the previous CA during a CA rotation, docs/identity.md)")
	fs.DurationVar(&c.CAReloadInterval, "ca-reload-interval", 10*time.Second, "how often --ca-cert, --ca-key and --ca-trust-bundle are read again; a changed CA re-mints every SVID, a changed bundle is pushed at once (0 = never)")
	fs.DurationVar(&c.SVIDTTL, "svid-ttl", 4*time.Hour, "lifetime of each X.509-SVID; SVIDs rotate at half of it (at least "+MinSVIDTTL.String()+")")
	fs.StringVar(&c.WorkloadAPISocket, "workload-api-socket", ProxySocketDir+"/"+meshcontract.WorkloadAPISocketName, "unix socket serving the SPIFFE Workload API (X.509-SVIDs of this node's managed pods) to aether-proxy, mode 0600, --allowed-uids; served only with --ca-cert")
	fs.BoolVar(&c.ExternalIdentities, "external-identities", false, "the pods' SPIFFE identities come from another provider (SPIRE: aether-proxy -spire-admin-socket): listeners carry each pod's SPIFFE ID and workloads are served tunnel_protocol HBONE without --ca-cert; refused together with --ca-cert")
	fs.StringVar(&c.InboundPolicy, "inbound-policy", meshcontract.InboundPolicyPermissive, "inbound policy of a pod without a valid "+meshcontract.InboundPolicyAnnotation+" annotation: permissive (plaintext delivered too) or strict (only HBONE; needs aether-cni's capture.inbound_capture); an invalid annotation is served strict")
	fs.StringVar(&c.text.locality, "locality", "", "node locality region/zone/subzone; empty reads the Node's topology labels (Kubernetes source only)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: aether-agent [flags]\n\nThe aether node agent: serves aether.cni.v1.CNIService, keeps durable pod records\nand registers mesh-managed pods' endpoints.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	return fs
}

// Validate completes c from the text of its list and locality flags
// (--allowed-uids, --system-namespaces, --etcd-endpoints and --locality,
// which flagSet registers; consumed once, so a Config built without flags
// keeps its fields) and checks every field, in the order the flags were
// always checked: the first invalid one is named. It reads no file
// (ParseFlags loads the CA after it).
func (c *Config) Validate() error {
	text := c.text
	c.text = flagText{}
	if c.GCPercent < 1 {
		return fmt.Errorf("invalid --gc-percent %d: want at least 1", c.GCPercent)
	}
	if err := c.addUIDs(text.uids); err != nil {
		return err
	}
	c.SystemNamespaces = appendList(c.SystemNamespaces, text.sysNS)
	c.EtcdEndpoints = appendList(c.EtcdEndpoints, text.etcdEndpoints)
	if err := c.validateRegistry(); err != nil {
		return err
	}
	if err := c.validateServing(); err != nil {
		return err
	}
	if err := c.setLocality(text.locality); err != nil {
		return err
	}
	if c.NodeName == "" {
		return errors.New("invalid --node-name: empty (set it, $NODE_NAME or a hostname)")
	}
	if c.CNISocket == "" || c.StateDir == "" {
		return errors.New("--cni-socket and --state-dir are required")
	}
	if c.LivenessInterval <= 0 || c.PodWait <= 0 {
		return errors.New("--liveness-interval and --pod-wait must be positive")
	}
	return nil
}

// addUIDs appends the uids of the comma-separated list uids (the text of
// --allowed-uids) to AllowedUIDs, which must then hold at least one.
func (c *Config) addUIDs(uids string) error {
	for _, s := range strings.Split(uids, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		u, err := strconv.ParseUint(s, 10, 32)
		if err != nil {
			return fmt.Errorf("invalid --allowed-uids entry %q: want a decimal uid", s)
		}
		c.AllowedUIDs = append(c.AllowedUIDs, uint32(u))
	}
	if len(c.AllowedUIDs) == 0 {
		return errors.New("invalid --allowed-uids: at least one uid is required")
	}
	return nil
}

// appendList appends the non-empty entries of the comma-separated list s
// to dst.
func appendList(dst []string, s string) []string {
	for _, e := range strings.Split(s, ",") {
		if e = strings.TrimSpace(e); e != "" {
			dst = append(dst, e)
		}
	}
	return dst
}

// validateRegistry checks --registry and what it needs: no
// --pod-manifests for kube, endpoints and their transport for etcd.
func (c *Config) validateRegistry() error {
	switch c.Registry {
	case "local":
	case "kube":
		if c.PodManifests != "" {
			return errors.New("invalid --registry=kube with --pod-manifests: the kube registry reads other nodes' pods from the Kubernetes API; use --registry=local or etcd on a node without one")
		}
	case "etcd":
		if len(c.EtcdEndpoints) == 0 {
			return errors.New("invalid --registry=etcd: --etcd-endpoints is empty; give the etcd client URLs")
		}
		if err := c.etcdOptions().CheckTransport(); err != nil {
			if errors.Is(err, etcdreg.ErrTLSOverHTTP) {
				return fmt.Errorf("invalid --etcd-endpoints: %w; --etcd-ca, --etcd-cert and --etcd-key need https:// endpoints, even with --etcd-insecure", err)
			}
			return fmt.Errorf("invalid --etcd-endpoints: %w; pass --etcd-insecure to allow plaintext etcd", err)
		}
	default:
		return fmt.Errorf("invalid --registry %q: want local, kube or etcd", c.Registry)
	}
	return nil
}

// validateServing checks what the served workloads and policies carry:
// --inbound-policy, --xds-address and its TLS flags, --cluster-id,
// --root-namespace and --cluster-domain.
func (c *Config) validateServing() error {
	if !meshcontract.ValidInboundPolicy(c.InboundPolicy) {
		return fmt.Errorf("invalid --inbound-policy %q: want %s or %s", c.InboundPolicy, meshcontract.InboundPolicyPermissive, meshcontract.InboundPolicyStrict)
	}
	if err := c.checkXDSAddress(); err != nil {
		return err
	}
	if (c.XDSSocket != "" || c.XDSAddress != "") && c.ClusterID == "" {
		return errors.New("invalid --cluster-id: empty; workload uids need the cluster name")
	}
	if errs := validation.IsDNS1123Label(c.RootNamespace); len(errs) > 0 {
		return fmt.Errorf("invalid --root-namespace %q: %s; want a namespace name", c.RootNamespace, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(c.ClusterDomain); len(errs) > 0 {
		return fmt.Errorf("invalid --cluster-domain %q: %s; want a DNS domain such as cluster.local", c.ClusterDomain, strings.Join(errs, "; "))
	}
	return nil
}

// setLocality sets Locality from locality (the text of --locality,
// region[/zone[/subzone]]); empty keeps it.
func (c *Config) setLocality(locality string) error {
	if locality == "" {
		return nil
	}
	parts := strings.Split(locality, "/")
	if len(parts) > 3 {
		return fmt.Errorf("invalid --locality %q: want region[/zone[/subzone]]", locality)
	}
	parts = append(parts, "", "")
	c.Locality = registry.Locality{Region: parts[0], Zone: parts[1], Subzone: parts[2]}
	return nil
}

// loadCA reads and validates --ca-cert and --ca-key at now. Both empty
// leaves identity off; one without the other, an unreadable file or a CA
// ParseCA refuses is a configuration error.
func (c *Config) loadCA(now time.Time) error {
	if c.ExternalIdentities && (c.CACertFile != "" || c.CAKeyFile != "") {
		return errors.New("invalid --external-identities with --ca-cert/--ca-key: the pods' identities come from one provider, either the embedded CA or an external one (SPIRE)")
	}
	if c.CACertFile == "" && c.CAKeyFile == "" {
		if c.CATrustBundleFile != "" {
			return errors.New("invalid --ca-trust-bundle: it extends the bundle of --ca-cert; give --ca-cert and --ca-key too")
		}
		return nil
	}
	if c.CACertFile == "" || c.CAKeyFile == "" {
		return errors.New("invalid --ca-cert/--ca-key: give both (the CA certificate and its key) or neither (identity off)")
	}
	if c.SVIDTTL < MinSVIDTTL {
		return fmt.Errorf("invalid --svid-ttl %s: want at least %s", c.SVIDTTL, MinSVIDTTL)
	}
	if c.WorkloadAPISocket == "" {
		return errors.New("invalid --workload-api-socket: empty; identity (--ca-cert) is served on it")
	}
	td, err := spiffeid.TrustDomainFromString(c.TrustDomain)
	if err != nil {
		return fmt.Errorf("invalid --trust-domain %q: %w", c.TrustDomain, err)
	}
	if c.CAReloadInterval < 0 {
		return fmt.Errorf("invalid --ca-reload-interval %s: want 0 (never) or more", c.CAReloadInterval)
	}
	ca, anchors, err := c.readCA(td, now)
	if err != nil {
		return err
	}
	c.CA, c.CAAnchors = ca, anchors
	return nil
}

// readCA reads and validates --ca-cert, --ca-key and --ca-trust-bundle for
// td at now (at start, and at every reload).
func (c *Config) readCA(td spiffeid.TrustDomain, now time.Time) (*identity.CA, []*x509.Certificate, error) {
	certPEM, err := os.ReadFile(c.CACertFile)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to read --ca-cert %q: %w", c.CACertFile, err)
	}
	keyPEM, err := os.ReadFile(c.CAKeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to read --ca-key %q: %w", c.CAKeyFile, err)
	}
	ca, err := identity.ParseCA(certPEM, keyPEM, td, now)
	if err != nil {
		return nil, nil, fmt.Errorf("invalid --ca-cert %q / --ca-key %q: %w", c.CACertFile, c.CAKeyFile, err)
	}
	if c.CATrustBundleFile == "" {
		return ca, nil, nil
	}
	bundlePEM, err := os.ReadFile(c.CATrustBundleFile)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to read --ca-trust-bundle %q: %w", c.CATrustBundleFile, err)
	}
	anchors, err := identity.ParseTrustAnchors(bundlePEM, td, now)
	if err != nil {
		return nil, nil, fmt.Errorf("invalid --ca-trust-bundle %q: %w", c.CATrustBundleFile, err)
	}
	return ca, anchors, nil
}

// etcdOptions are the etcd registry options the flags give (without the
// logger).
func (c *Config) etcdOptions() etcdreg.Options {
	return etcdreg.Options{
		Endpoints: c.EtcdEndpoints, Node: c.NodeName, Prefix: c.EtcdPrefix, LeaseTTL: c.EtcdLeaseTTL,
		CAFile: c.EtcdCAFile, CertFile: c.EtcdCertFile, KeyFile: c.EtcdKeyFile, Insecure: c.EtcdInsecure,
	}
}
