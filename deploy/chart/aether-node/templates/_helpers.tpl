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
Host paths. The agent serves its sockets from agent/ below run, a directory
it creates 0700 itself (kubelet creates the hostPath 0755, which the agent
refuses as a socket directory); aether-cni pins network namespaces in netns/.
*/}}
{{- define "aether-node.runDir" -}}/run/aether{{- end -}}
{{- define "aether-node.socketDir" -}}/run/aether/agent{{- end -}}
{{- define "aether-node.stateDir" -}}/var/lib/aether{{- end -}}
{{- define "aether-node.etcdTLSDir" -}}/etc/aether/etcd{{- end -}}
{{- define "aether-node.identityDir" -}}/etc/aether/identity{{- end -}}
{{/* The Secret of the identity CA: the one given, or the generated one. */}}
{{- define "aether-node.identityCASecret" -}}
{{- .Values.identity.caSecret | default (printf "%s-identity-ca" (include "aether-node.fullname" .)) -}}
{{- end -}}

{{/* Fails the render on values the binaries would reject. */}}
{{- define "aether-node.validate" -}}
{{- $levels := list "debug" "info" "warn" "error" -}}
{{- if not (has .Values.logLevel $levels) -}}
{{- fail (printf "invalid logLevel %q: must be debug, info, warn or error" .Values.logLevel) -}}
{{- end -}}
{{- if not (has .Values.cni.pluginLogLevel (append $levels "")) -}}
{{- fail (printf "invalid cni.pluginLogLevel %q: must be empty, debug, info, warn or error" .Values.cni.pluginLogLevel) -}}
{{- end -}}
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
{{- if not (has .Values.registry.mode (list "local" "etcd")) -}}
{{- fail (printf "invalid registry.mode %q: must be local or etcd" .Values.registry.mode) -}}
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
{{- if not (isAbs (.Values.identity.spire.adminSocket | default "")) -}}
{{- fail (printf "invalid identity.spire.adminSocket %q: must be the absolute host path of the SPIRE agent's admin socket" (.Values.identity.spire.adminSocket | default "")) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.identity.enabled (eq .Values.identity.provider "embedded") (not .Values.identity.caSecret) (not .Values.identity.generateCA) -}}
{{- fail "invalid identity: enabled without a CA; set identity.caSecret (a Secret with tls.crt and tls.key) or identity.generateCA" -}}
{{- end -}}
{{- if and .Values.identity.enabled .Values.identity.caSecret .Values.identity.generateCA -}}
{{- fail "invalid identity: both caSecret and generateCA are set; give one" -}}
{{- end -}}
{{- end -}}
