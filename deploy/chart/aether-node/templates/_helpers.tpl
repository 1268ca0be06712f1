{{/* Name of every object: the release name, or <release>-aether-node when it does not say aether-node. */}}
{{- define "aether-node.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the DaemonSet's pods (never change across upgrades). */}}
{{- define "aether-node.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "aether-node.labels" -}}
{{ include "aether-node.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The image of every container. */}}
{{- define "aether-node.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
Host paths (values hostPaths), each mounted at the same path in the
containers. The agent serves its own sockets (CNI, admin) from agent/ below
runDir, a directory it creates 0700 itself (kubelet creates the hostPath
0755, which the agent refuses as a socket directory), and the three the
proxy consumes (xDS, LDS, Workload API, with the Workload API token file)
from proxy/, a hostPath of its own that kubelet creates and the agent
tightens to 0700: the proxy mounts proxy/, netns/ and uds/, never agent/.
The proxy serves its own socket (the flows aetherctl flows follows) from
proxy-flows/, a hostPath only it mounts (kubelet creates it 0755; the socket
is 0600, root's).
aether-cni pins network namespaces in netns/; the pods' UDS socket dirs are
in uds/.
*/}}
{{- define "aether-node.runDir" -}}{{ .Values.hostPaths.runDir }}{{- end -}}
{{- define "aether-node.socketDir" -}}{{ .Values.hostPaths.runDir }}/agent{{- end -}}
{{- define "aether-node.proxySocketDir" -}}{{ .Values.hostPaths.runDir }}/proxy{{- end -}}
{{- define "aether-node.proxyFlowsDir" -}}{{ .Values.hostPaths.runDir }}/proxy-flows{{- end -}}
{{- define "aether-node.pinDir" -}}{{ .Values.hostPaths.runDir }}/netns{{- end -}}
{{- define "aether-node.udsRoot" -}}{{ .Values.hostPaths.runDir }}/uds{{- end -}}
{{- define "aether-node.stateDir" -}}{{ .Values.hostPaths.stateDir }}{{- end -}}
{{- define "aether-node.kubeletDir" -}}{{ .Values.hostPaths.kubeletDir }}{{- end -}}
{{/* Container paths: secrets, never host paths. */}}
{{- define "aether-node.etcdTLSDir" -}}/etc/aether/etcd{{- end -}}
{{- define "aether-node.identityDir" -}}/etc/aether/identity{{- end -}}
{{/* install-cni's ready file, in an emptyDir (its root file system is read-only). */}}
{{- define "aether-node.installerReadyDir" -}}/etc/aether/install-cni{{- end -}}
{{/* Where client-go's in-cluster config and aether-cni-install read the
ServiceAccount token, the cluster CA and the namespace. */}}
{{- define "aether-node.serviceAccountDir" -}}/var/run/secrets/kubernetes.io/serviceaccount{{- end -}}
{{/* The Secret of the identity CA: the one given, or the generated one. */}}
{{- define "aether-node.identityCASecret" -}}
{{- .Values.identity.caSecret | default (printf "%s-identity-ca" (include "aether-node.fullname" .)) -}}
{{- end -}}

{{/*
Fails the render unless the host path (list name path maxLen) is an
absolute, clean path of at most maxLen bytes (0: no limit).
*/}}
{{- define "aether-node.validateHostPath" -}}
{{- $name := index . 0 -}}
{{- $p := index . 1 -}}
{{- $max := index . 2 -}}
{{- if not (kindIs "string" $p) -}}
{{- fail (printf "invalid %s %v: must be a host path such as /run/aether" $name $p) -}}
{{- end -}}
{{- if not (isAbs $p) -}}
{{- fail (printf "invalid %s %q: must be an absolute host path" $name $p) -}}
{{- end -}}
{{- if eq $p "/" -}}
{{- fail (printf "invalid %s %q: must not be the host's root directory" $name $p) -}}
{{- end -}}
{{- if hasSuffix "/" $p -}}
{{- fail (printf "invalid %s %q: must not end in a slash; use %q" $name $p (clean $p)) -}}
{{- end -}}
{{- if has ".." (splitList "/" $p) -}}
{{- fail (printf "invalid %s %q: must not contain .." $name $p) -}}
{{- end -}}
{{- if ne (clean $p) $p -}}
{{- fail (printf "invalid %s %q: must be a clean path (no . or empty segments); use %q" $name $p (clean $p)) -}}
{{- end -}}
{{- if not (regexMatch "^[A-Za-z0-9._+@/-]+$" $p) -}}
{{- fail (printf "invalid %s %q: may contain only letters, digits, / and ._+@-" $name $p) -}}
{{- end -}}
{{- if and $max (gt (len $p) (int $max)) -}}
{{- fail (printf "invalid %s %q: %d bytes, at most %d: the longest unix socket below it would exceed 107 bytes" $name $p (len $p) (int $max)) -}}
{{- end -}}
{{- end -}}

{{/*
Fails the render unless every host path is valid and none is another's, lies
inside another or holds one of the container paths the chart mounts (each is
a mount of its own at the same path in the containers).
*/}}
{{- define "aether-node.validateHostPaths" -}}
{{- $hp := .Values.hostPaths -}}
{{- range $old, $new := dict "cni.binDir" "cniBinDir" "cni.confDir" "cniConfDir" "csi.kubeletDir" "kubeletDir" -}}
{{- $parts := splitList "." $old -}}
{{- if hasKey (index $.Values (first $parts)) (last $parts) -}}
{{- fail (printf "invalid %s: moved to hostPaths.%s" $old $new) -}}
{{- end -}}
{{- end -}}
{{- /* The sockets below runDir: the agent's own in agent/, the ones the
proxy dials in proxy/, the proxy's own in proxy-flows/
(aether-node.socketDir, aether-node.proxySocketDir,
aether-node.proxyFlowsDir); runDir may be as long as the longest of them
allows. */ -}}
{{- $socketLen := 0 -}}
{{- range list "/agent/cni.sock" "/agent/admin.sock" "/proxy/xds.sock" "/proxy/lds.sock" "/proxy/workload.sock" "/proxy-flows/flows.sock" -}}
{{- $socketLen = max $socketLen (len .) -}}
{{- end -}}
{{- $regLen := 40 -}}{{/* /plugins_registry/csi.aether.io-reg.sock */}}
{{- $checks := list
  (list "hostPaths.runDir" $hp.runDir (sub 107 $socketLen))
  (list "hostPaths.stateDir" $hp.stateDir 0)
  (list "hostPaths.cniBinDir" $hp.cniBinDir 0)
  (list "hostPaths.cniConfDir" $hp.cniConfDir 0) -}}
{{- if .Values.csi.enabled -}}
{{- $checks = append $checks (list "hostPaths.kubeletDir" $hp.kubeletDir (sub 107 $regLen)) -}}
{{- end -}}
{{- $spire := and .Values.identity.enabled (eq .Values.identity.provider "spire") -}}
{{- if $spire -}}
{{- $checks = append $checks (list "identity.spire.adminSocket" .Values.identity.spire.adminSocket 107) -}}
{{- end -}}
{{- range $checks -}}
{{- include "aether-node.validateHostPath" . -}}
{{- end -}}
{{- /* Each entry: name, path, whether it is a value (blamed) or a container path. */ -}}
{{- $paths := list -}}
{{- range list "/usr/local/bin" "/etc/aether" "/host/cni" "/csi" "/registration" (include "aether-node.serviceAccountDir" .) -}}
{{- $paths = append $paths (list "the container path" . false) -}}
{{- end -}}
{{- range $checks -}}
{{- if eq (index . 0) "identity.spire.adminSocket" -}}
{{- $paths = append $paths (list "identity.spire.adminSocket's directory" (dir (index . 1)) true) -}}
{{- else -}}
{{- $paths = append $paths (list (index . 0) (index . 1) true) -}}
{{- end -}}
{{- end -}}
{{- range $i, $a := $paths -}}
{{- range $j, $b := $paths -}}
{{- if and (lt $i $j) (index $b 2) -}}
{{- /* b, a value, is blamed; a is a value or a container path. */ -}}
{{- $rel := "" -}}
{{- if eq (index $a 1) (index $b 1) -}}
{{- $rel = "is the same path as" -}}
{{- else if hasPrefix (printf "%s/" (index $a 1)) (index $b 1) -}}
{{- $rel = "lies inside" -}}
{{- else if hasPrefix (printf "%s/" (index $b 1)) (index $a 1) -}}
{{- $rel = "holds" -}}
{{- end -}}
{{- if $rel -}}
{{- fail (printf "invalid %s %q: %s %s %q; each host path is a mount of its own, apart from the others and from the container paths the chart uses" (index $b 0) (index $b 1) $rel (index $a 0) (index $a 1)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Fails the render on values the binaries would reject. */}}
{{- define "aether-node.validate" -}}
{{- include "aether-node.validateHostPaths" . -}}
{{- $levels := list "debug" "info" "warn" "error" -}}
{{- if not (has .Values.logLevel $levels) -}}
{{- fail (printf "invalid logLevel %q: must be debug, info, warn or error" .Values.logLevel) -}}
{{- end -}}
{{- if not (has .Values.cni.pluginLogLevel (append $levels "")) -}}
{{- fail (printf "invalid cni.pluginLogLevel %q: must be empty, debug, info, warn or error" .Values.cni.pluginLogLevel) -}}
{{- end -}}
{{- with .Values.cni.criSocket -}}
{{- if not (and (kindIs "string" .) (or (eq . "none") (regexMatch "^unix:///[A-Za-z0-9._+@/-]+$" .))) -}}
{{- fail (printf "invalid cni.criSocket %v: must be empty (the plugin's default, containerd's unix:///run/containerd/containerd.sock), none, or unix:///<absolute host path> such as k3s's unix:///run/k3s/containerd/containerd.sock" .) -}}
{{- end -}}
{{- if and (ne . "none") (ne (clean (trimPrefix "unix://" .)) (trimPrefix "unix://" .)) -}}
{{- fail (printf "invalid cni.criSocket %q: the path must be clean (no trailing slash, no . or .., no //)" .) -}}
{{- end -}}
{{- end -}}
{{- include "aether-node.validateRuntime" . -}}
{{- if not (has .Values.cni.captureFailure (list "fail" "open")) -}}
{{- fail (printf "invalid cni.captureFailure %q: must be fail or open" .Values.cni.captureFailure) -}}
{{- end -}}
{{- if not (has .Values.inboundPolicy (list "permissive" "strict")) -}}
{{- fail (printf "invalid inboundPolicy %q: must be permissive or strict" .Values.inboundPolicy) -}}
{{- end -}}
{{- if and (eq .Values.inboundPolicy "strict") (not .Values.cni.inboundCapture) -}}
{{- fail "invalid inboundPolicy strict without cni.inboundCapture: plaintext would bypass the proxy; set cni.inboundCapture: true" -}}
{{- end -}}
{{- if not (has .Values.cni.primary (list "" "eni-vlan")) -}}
{{- fail (printf "invalid cni.primary %q: must be empty or eni-vlan" .Values.cni.primary) -}}
{{- end -}}
{{- if not (has .Values.cni.uninstallOnExit (list "auto" "always" "never")) -}}
{{- fail (printf "invalid cni.uninstallOnExit %q: must be auto, always or never" .Values.cni.uninstallOnExit) -}}
{{- end -}}
{{- if not (has .Values.csi.registrar (list "builtin" "sidecar")) -}}
{{- fail (printf "invalid csi.registrar %q: must be builtin or sidecar" .Values.csi.registrar) -}}
{{- end -}}
{{- if not (has .Values.registry.mode (list "local" "kube" "etcd")) -}}
{{- fail (printf "invalid registry.mode %q: must be kube, etcd or local" .Values.registry.mode) -}}
{{- end -}}
{{- if and (eq .Values.registry.mode "etcd") (empty .Values.registry.etcd.endpoints) -}}
{{- fail "invalid registry.etcd.endpoints: empty with registry.mode etcd; give the etcd client URLs" -}}
{{- end -}}
{{- if and (eq .Values.registry.mode "etcd") (not .Values.registry.etcd.tlsSecret.name) (not .Values.registry.etcd.insecure) -}}
{{- fail "invalid registry.etcd: no tlsSecret.name and insecure is false; give the TLS Secret or allow plaintext etcd" -}}
{{- end -}}
{{- if not .Values.clusterID -}}
{{- fail "invalid clusterID: empty; workload uids need the cluster name" -}}
{{- end -}}
{{- if not (has .Values.identity.provider (list "embedded" "spire")) -}}
{{- fail (printf "invalid identity.provider %q: must be embedded or spire" .Values.identity.provider) -}}
{{- end -}}
{{- if and .Values.identity.enabled (eq .Values.identity.provider "spire") -}}
{{- if or .Values.identity.caSecret .Values.identity.generateCA .Values.identity.trustBundleConfigMap -}}
{{- fail "invalid identity: provider spire with caSecret, generateCA or trustBundleConfigMap: SPIRE signs the SVIDs and no node holds a CA; unset them or use provider embedded" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.identity.enabled (eq .Values.identity.provider "embedded") (not .Values.identity.caSecret) (not .Values.identity.generateCA) -}}
{{- fail "invalid identity: enabled without a CA; set identity.caSecret (a Secret with tls.crt and tls.key) or identity.generateCA" -}}
{{- end -}}
{{- if and .Values.identity.enabled .Values.identity.caSecret .Values.identity.generateCA -}}
{{- fail "invalid identity: both caSecret and generateCA are set; give one" -}}
{{- end -}}
{{- end -}}

{{/* Fails the render on ports, drain times or an update strategy the
binaries or the API server would reject. */}}
{{- define "aether-node.validateRuntime" -}}
{{- range $name := list "agentHTTP" "proxyAdmin" -}}
{{- $p := index $.Values.ports $name -}}
{{- if not (and (or (kindIs "float64" $p) (kindIs "int" $p) (kindIs "int64" $p)) (eq (float64 $p) (floor $p)) (ge (float64 $p) 1.0) (le (float64 $p) 65535.0)) -}}
{{- fail (printf "invalid ports.%s %v: must be a port number, 1-65535" $name $p) -}}
{{- end -}}
{{- end -}}
{{- if eq (float64 .Values.ports.agentHTTP) (float64 .Values.ports.proxyAdmin) -}}
{{- fail (printf "invalid ports.proxyAdmin %v: the same port as ports.agentHTTP; both listen on the node's 127.0.0.1" .Values.ports.proxyAdmin) -}}
{{- end -}}
{{- include "aether-node.validateMetrics" . -}}
{{- $hb := .Values.hbonePort -}}
{{- if not (and (or (kindIs "float64" $hb) (kindIs "int" $hb) (kindIs "int64" $hb)) (eq (float64 $hb) (floor $hb)) (ge (float64 $hb) 1.0) (le (float64 $hb) 65535.0)) -}}
{{- fail (printf "invalid hbonePort %v: must be a port number, 1-65535 (Istio's is 15008)" $hb) -}}
{{- end -}}
{{- if has (float64 $hb) (list 18001.0 18008.0 18081.0) -}}
{{- fail (printf "invalid hbonePort %v: one of the capture's own ports in the pod (18001 capture, 18008 inbound, 18081 outbound and readiness); Istio's is 15008" $hb) -}}
{{- end -}}
{{- $grace := .Values.terminationGracePeriodSeconds -}}
{{- if not (and (or (kindIs "float64" $grace) (kindIs "int" $grace) (kindIs "int64" $grace)) (eq (float64 $grace) (floor $grace)) (ge (float64 $grace) 1.0)) -}}
{{- fail (printf "invalid terminationGracePeriodSeconds %v: must be a whole number of seconds, at least 1" $grace) -}}
{{- end -}}
{{- $drain := .Values.proxy.shutdownDrainSeconds -}}
{{- if not (and (or (kindIs "float64" $drain) (kindIs "int" $drain) (kindIs "int64" $drain)) (eq (float64 $drain) (floor $drain)) (ge (float64 $drain) 0.0)) -}}
{{- fail (printf "invalid proxy.shutdownDrainSeconds %v: must be a whole number of seconds, 0 or more" $drain) -}}
{{- end -}}
{{- if gt (addf $drain 10) (float64 $grace) -}}
{{- fail (printf "invalid proxy.shutdownDrainSeconds %v: must be at least 10 below terminationGracePeriodSeconds (%v), or kubelet kills the proxy before its connections finish or the install-cni sidecar, stopped last, before it uninstalls" $drain $grace) -}}
{{- end -}}
{{- $podDrain := .Values.proxy.podDrainSeconds -}}
{{- if not (and (or (kindIs "float64" $podDrain) (kindIs "int" $podDrain) (kindIs "int64" $podDrain)) (eq (float64 $podDrain) (floor $podDrain)) (ge (float64 $podDrain) 1.0)) -}}
{{- fail (printf "invalid proxy.podDrainSeconds %v: must be a whole number of seconds, at least 1" $podDrain) -}}
{{- end -}}
{{- if not (has .Values.proxy.accessLog (list "off" "errors" "all")) -}}
{{- fail (printf "invalid proxy.accessLog %v: must be off, errors or all" .Values.proxy.accessLog) -}}
{{- end -}}
{{- $rate := .Values.proxy.accessLogSampleRate -}}
{{- if not (and (or (kindIs "float64" $rate) (kindIs "int" $rate) (kindIs "int64" $rate)) (ge (float64 $rate) 0.0) (le (float64 $rate) 1.0)) -}}
{{- fail (printf "invalid proxy.accessLogSampleRate %v: must be a number from 0 to 1" $rate) -}}
{{- end -}}
{{- $mu := .Values.maxUnavailable -}}
{{- if kindIs "string" $mu -}}
{{- if not (regexMatch "^([1-9][0-9]?|100)%$" $mu) -}}
{{- fail (printf "invalid maxUnavailable %q: must be a number of at least 1 or a percentage from 1%% to 100%%" $mu) -}}
{{- end -}}
{{- else if not (and (or (kindIs "float64" $mu) (kindIs "int" $mu) (kindIs "int64" $mu)) (eq (float64 $mu) (floor $mu)) (ge (float64 $mu) 1.0)) -}}
{{- fail (printf "invalid maxUnavailable %v: must be a number of at least 1 or a percentage from 1%% to 100%%" $mu) -}}
{{- end -}}
{{- end -}}

{{/* Fails the render on metrics values the binaries or Prometheus would
reject: ports that are no port or collide (the node's address also holds
the loopback ports: the pod is hostNetwork), a PodMonitor mode or scrape
interval that is not one. */}}
{{- define "aether-node.validateMetrics" -}}
{{- $m := .Values.metrics -}}
{{- if $m.enabled -}}
{{- range $name := list "agentPort" "proxyPort" -}}
{{- $p := index $m $name -}}
{{- if not (and (or (kindIs "float64" $p) (kindIs "int" $p) (kindIs "int64" $p)) (eq (float64 $p) (floor $p)) (ge (float64 $p) 1.0) (le (float64 $p) 65535.0)) -}}
{{- fail (printf "invalid metrics.%s %v: must be a port number, 1-65535" $name $p) -}}
{{- end -}}
{{- end -}}
{{- $taken := dict (toString (float64 $.Values.ports.agentHTTP)) "ports.agentHTTP" (toString (float64 $.Values.ports.proxyAdmin)) "ports.proxyAdmin" -}}
{{- range $name := list "agentPort" "proxyPort" -}}
{{- $k := toString (float64 (index $m $name)) -}}
{{- with index $taken $k -}}
{{- fail (printf "invalid metrics.%s %v: the same port as %s; the pod is hostNetwork, so every port is the node's" $name (index $m $name) .) -}}
{{- end -}}
{{- $_ := set $taken $k (printf "metrics.%s" $name) -}}
{{- end -}}
{{- end -}}
{{- if not (has (toString $m.podMonitor.enabled) (list "auto" "always" "never")) -}}
{{- fail (printf "invalid metrics.podMonitor.enabled %v: must be auto, always or never" $m.podMonitor.enabled) -}}
{{- end -}}
{{- if not (regexMatch "^[0-9]+(ms|s|m|h)$" (toString $m.podMonitor.interval)) -}}
{{- fail (printf "invalid metrics.podMonitor.interval %v: must be a Prometheus duration such as 15s or 1m" $m.podMonitor.interval) -}}
{{- end -}}
{{- if and (not $m.enabled) (or (eq (toString $m.podMonitor.enabled) "always") $m.scrapeConfig.enabled) -}}
{{- fail "invalid metrics: podMonitor.enabled always or scrapeConfig.enabled with metrics.enabled false; nothing serves /metrics on the node's address to scrape" -}}
{{- end -}}
{{- end -}}
