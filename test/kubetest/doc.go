// Package kubetest runs a real kube-apiserver on an embedded etcd for the
// tests that need one (the agent's pod source, the chart's server-side
// dry-run, the Kubernetes lane). The binaries come from the scratch module
// test/kube (its own go.mod, so k8s.io/kubernetes never enters this module's
// go.mod) and are built once per machine into harness.CacheDir()/kube/<versions>/:
// etcd and kube-apiserver always, kube-controller-manager, kube-scheduler
// and kubelet when a test asks (BinDir's extra names). A cold build takes
// about 8–13 minutes for kube-apiserver on 2 cores, and 5–9 minutes for
// each of the others on a busy machine.
//
// StartWith can run the cluster inside a network namespace (Options.NetNS):
// the API then listens on that namespace's loopback only, the returned
// client dials through the namespace, and Cluster.Run starts further
// processes (controller-manager, scheduler, kubelet) next to it; Stop ends
// them newest first, kube-apiserver before etcd.
//
// Cluster.StopAPIServer stops kube-apiserver alone (SIGTERM by PID, SIGKILL
// after 2 s: under the lane's kubelet it never finished its graceful
// shutdown within 10 s); etcd and the processes Run started keep running.
// Cluster.StartAPIServer runs it again with the same command line: the
// same port, certificates (the pair it wrote in certs/ is reused), etcd
// data, service-account keys and flags, so the Cluster's Config,
// Kubeconfig, kubelet and in-cluster clients reconnect unchanged; it waits
// for /readyz (about 3-5 s warm here). A test that ends with the API server
// down gets it started again in its Cleanup, so later steps keep it.
package kubetest
