// Package kubernetes is the Kubernetes lane: aether-node under a real
// kubelet, on a single-node Kubernetes v1.37 the test starts itself
// (issue 11, item 6).
//
// # What it starts
//
// Everything runs in one network namespace, the node's "host network"
// (harness.NewNS, with a dummy link carrying the node IP 192.0.2.2 and a
// default route on it), so nothing touches the machine's own network:
//   - etcd and kube-apiserver (test/kubetest, --allow-privileged=true),
//     kube-controller-manager and kube-scheduler, all on the namespace's
//     loopback; the test's client dials through the namespace;
//   - containerd 1.6 + runc (test/containerd.Start: own root, state,
//     socket, runc root; CNI bin and conf dirs in its directory) with the
//     primary conflist bridge + host-local (the reference plugins);
//   - kubelet (failCgroupV1: false, cgroupfs, registerWithTaints
//     aether.io/agent-not-ready:NoSchedule, --node-labels with the
//     topology labels region/zone/subzone the agent reads as its locality;
//     root, cert, pod-log and volume plugin dirs in the lane's directory).
//
// hostNetwork pods (the aether-node DaemonSet) share that namespace,
// because runc inherits containerd's. The binaries are built once per
// machine into harness.CacheDir()/kube/<versions> (kubetest.BinDir).
//
// # What it installs and checks
//
// The image is built by tools/image (what `make image` runs) and imported
// with ctr under two tags. The Helm chart (deploy/chart) is rendered with
// the lane's values (image, pull policy Never, every hostPaths value in the
// lane's directory: the CNI dirs of the lane's containerd, the lane
// kubelet's root dir as kubeletDir, and runDir and stateDir, which the
// chart mounts at the same path in the containers) and its objects created
// (aether-csi registers itself, csi.registrar builtin; identity.enabled with
// generateCA: the agent signs the managed pods' SVIDs with the CA Secret
// the chart renders, aether-proxy serves HBONE on every managed pod's
// :15008 and WDS marks them tunnel_protocol HBONE, so traffic between
// managed pods is tunnelled over mTLS); where the chart has no value the
// DaemonSet is adapted: the pods reach the API server on the node's
// loopback (no kube-proxy, so the Service IP does not route). Then, in
// order:
//   - the DaemonSet is Ready, the agent removed the agent-not-ready taint
//     (through the chart's node patch policy, with the token kubelet
//     projects into its pod), the installer chained aether-cni onto the
//     bridge conflist;
//   - managed pods are captured, served by aether-proxy and listed by
//     aetherctl (pods, workloads) with uid, service account and owner
//     Deployment; the unmanaged pod is untouched; traffic from a managed
//     pod goes through aether-proxy (its metrics name both workloads, over
//     HBONE with both principals, or "unknown" for the unmanaged
//     destination, in plain TCP);
//   - a ClusterIP Service of web (EndpointSlices from the
//     controller-manager) answers from the managed client with no
//     kube-proxy: its proxy resolves the VIP from workload discovery and
//     tunnels to web (path="service_hbone"); aetherctl services lists it;
//   - Istio's YAML on the CRDs the chart installed (policy.installCRDs
//     auto; cni.inboundCapture on, so plaintext reaches web's proxy too),
//     each checked by client (managed, HBONE) and plain (plaintext)
//     connections to web that must pass or be refused: a port-restricted
//     ALLOW (and its deletion), ALLOW one service account, DENY a
//     namespace, an L7 ALLOW rule failing safe, PeerAuthentication STRICT
//     and PERMISSIVE, and an open connection closed by a DENY applied
//     while it runs;
//   - Prometheus (prometheus_linux_test.go): Debian's prometheus, started
//     in the node netns right after the DaemonSet is Ready, scrapes both
//     metrics ports on the node's address every second through the scrape
//     configuration the chart installed (metrics.scrapeConfig; Debian's
//     build has no Kubernetes discovery, so the job's kubernetes_sd_configs
//     becomes a file the lane writes from the API in the shape Kubernetes
//     discovery gives, and the chart's relabelling runs unchanged); after a
//     DENY refused connections while it scraped and fresh HBONE and
//     plaintext traffic, Istio's TCP dashboard queries and every query of
//     the dashboard ConfigMap the chart installed return the expected
//     series and labels (the denial panel counts the DENY, the mTLS share
//     lies between 0 and 1);
//   - a deleted pod turns UNHEALTHY before it is removed (watched with
//     aetherctl workloads --watch), and its record goes with the DEL;
//   - a rolling update of the DaemonSet (new tag) keeps every record and
//     capture, never unchains the conflist (sampled every 10 ms), and a
//     pod created meanwhile starts captured (kubelet retries aether-cni's
//     code 11 while the agent restarts);
//   - UDS sockets (issue 14 item 3): the CSINode lists csi.aether.io
//     (aether-csi's built-in registration); a pod with an inline
//     csi.aether.io volume and endpoint.aether.io/uds-socket runs (kubelet
//     called NodePublishVolume), its app listens on that socket, aetherctl
//     pod shows <uds-csi-root>/<uid>/app.sock, where the socket answers;
//     inbound mesh traffic reaches the app through it: the client pod
//     (managed, captured) connects to the UDS pod's IP and app port, its
//     proxy tunnels the connection over HBONE to the pod's :15008 and the
//     proxy delivers it to the unix socket — the app writes a greeting
//     line first on its socket only (never on :8080), the client reads it,
//     aether_inbound_deliveries_total{via="uds"} counts one more and an
//     inbound connection from the client's SPIFFE ID is counted; WDS
//     serves the pod with the Node's locality and HBONE;
//     the same after the agent's container is stopped through CRI and
//     kubelet restarts it, once with the API server up and once with it
//     down (kubetest's StopAPIServer; kubelet restarts the container from
//     its local pod state, after its 10 s CrashLoopBackOff since it is the
//     second restart): the paths and refusals come from the agent's store,
//     the socket answers, aether-proxy has the path, the mesh connection
//     still reaches the socket (SVIDs served from the store), WDS serves
//     the pod exactly as before the restart (locality included: the
//     records carry it), /healthz is 200,
//     /readyz is 503 (no first sync), aether_agent_pods counts the
//     replayed records; StartAPIServer brings it back and the agent's
//     /readyz passes again; with the app's socket file removed the mesh
//     connection falls back to TCP (no greeting;
//     aether_inbound_deliveries_total{via="uds_fallback"}), never dropped;
//     pods declaring the volume twice or naming an emptyDir
//     show multiple_csi_volumes / not_csi in aetherctl pod and in
//     aether_agent_uds_refusals_total; deleting the pod unpublishes the
//     volume and removes <uds-csi-root>/<uid>/;
//   - uninstall (the chart's objects deleted) restores the conflist byte
//     for byte, removes the binary, and new pods are not captured.
//
// # Time
//
// The mesh checks of the UDS scenario reuse the lane's pods (the client
// Deployment, the UDS pod) and poll within bounded deadlines, no fixed
// sleep: each connection took 8-92 ms (first attempt) on the shared
// 2-core machine (2026-12-01). Whole lane there: 2m31-2m57 (five runs,
// load 8-12) against 3m20 for the lane before identities were on (one
// run, load 16): within the noise. The longest and most variable step is
// kubelet's teardown of the deleted UDS pods (2-30 s, 15 s before this
// change too): NodeUnpublishVolume succeeds at its first call, but kubelet
// starts the unmount some 14 s after the delete in a slow run.
//
// # What it restores
//
// The host-wide kernel settings kubelet rewrites (kernel.panic,
// kernel.panic_on_oops, vm.overcommit_memory, vm.panic_on_oom,
// kernel.keys.root_maxkeys/root_maxbytes) and the host's ip_forward are
// recorded before the start and restored in t.Cleanup, also when the test
// fails. A diff of /proc/sys (kernel, vm, fs, user, net/core, net/ipv4)
// before the lane and with the node up showed only the first three
// changing here (the keys limits already had kubelet's values; the bridge
// sets ip_forward in the node netns, not on the host).
//
// At teardown kubelet stops first, then the conflist gets its original
// bytes back (so sandbox DELs never wait for a gone agent), then
// containerd (its sandboxes removed, leftover shims ended by PID), then
// the control plane (kube-apiserver before etcd). Removed last: the mounts
// under the lane's directory (kubelet's bind mount of its root dir, pod
// volumes, netns pins), the lane's own cgroup root (kubelet's cgroupRoot,
// so the machine's /kubepods is never used), and the host directories
// kubelet cannot be told to avoid (/var/lib/kubelet/device-plugins,
// /var/log/containers) when the lane created them.
//
// # Failing, never skipping
//
// The lane needs root, containerd, runc and ctr (make deps); without them it
// fails with the package to install. Known noise in the logs: containerd
// 1.6's "RuntimeConfig ... Unimplemented", "Failed to set rlimit", "no
// imagefs label", kubelet's iptables canary errors (no iptables here).
package kubernetes
