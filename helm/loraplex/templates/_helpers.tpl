{{/* Names and labels */}}

{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* release-chart, or the release alone when it already holds the chart name; short enough
for the longest suffix added to it ("-etcd-headless") to stay a DNS label. */}}
{{- define "loraplex.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The Ray pods (head and workers): the Serve proxies, the ingress and the engine replicas. */}}
{{- define "loraplex.raySelectorLabels" -}}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/component: ray
{{- end -}}

{{- define "loraplex.etcdSelectorLabels" -}}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/component: etcd
{{- end -}}

{{- define "loraplex.etcdName" -}}{{ include "loraplex.fullname" . }}-etcd{{- end -}}
{{- define "loraplex.etcdHeadless" -}}{{ include "loraplex.fullname" . }}-etcd-headless{{- end -}}

{{- define "loraplex.internalEtcd" -}}
{{- if not .Values.etcd.external.endpoints -}}true{{- end -}}
{{- end -}}

{{- define "loraplex.adminKeySecret" -}}
{{- .Values.adminKey.existingSecret | default (printf "%s-admin-key" (include "loraplex.fullname" .)) -}}
{{- end -}}

{{- define "loraplex.metricsKeySecret" -}}
{{- .Values.metricsKey.existingSecret | default (printf "%s-metrics-key" (include "loraplex.fullname" .)) -}}
{{- end -}}

{{- define "loraplex.artifactsClaim" -}}
{{- .Values.artifacts.existingClaim | default (printf "%s-artifacts" (include "loraplex.fullname" .)) -}}
{{- end -}}

{{- define "loraplex.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Application config */}}

{{- define "loraplex.etcdTLSDir" -}}/etc/loraplex/etcd-tls{{- end -}}

{{/* The etcd endpoints the app dials: the chart's client Service, or the external ones. */}}
{{- define "loraplex.etcdEndpoints" -}}
{{- if include "loraplex.internalEtcd" . -}}
{{- list (printf "%s.%s.svc:2379" (include "loraplex.etcdName" .) .Release.Namespace) | toJson -}}
{{- else -}}
{{- .Values.etcd.external.endpoints | toJson -}}
{{- end -}}
{{- end -}}

{{/* Refusals the schema cannot express: settings the chart owns, secrets kept out of the
RayService, and LoraplexConfig's cross-field rule on GPUs. */}}
{{- define "loraplex.validate" -}}
{{- $app := .Values.loraplex -}}
{{- $etcd := $app.etcd | default dict -}}
{{- if $etcd.endpoints -}}
{{- fail "loraplex.etcd.endpoints is set by the chart: leave it unset, and set etcd.external.endpoints to use an etcd of your own" -}}
{{- end -}}
{{- if or $etcd.ca_cert $etcd.cert $etcd.key -}}
{{- fail "loraplex.etcd.ca_cert/cert/key are set by the chart: leave them unset, and name a Secret with ca.crt, tls.crt and tls.key in etcd.external.tlsSecret" -}}
{{- end -}}
{{- if or $etcd.username $etcd.password -}}
{{- fail "loraplex.etcd.username/password would be readable in the RayService's serveConfigV2: use client certificates (etcd.external.tlsSecret) instead" -}}
{{- end -}}
{{- if and .Values.etcd.external.tlsSecret (include "loraplex.internalEtcd" .) -}}
{{- fail "etcd.external.tlsSecret is set but etcd.external.endpoints is empty: the chart's own etcd takes plain connections; set the endpoints of the etcd that secret is for" -}}
{{- end -}}
{{- if not $app.model -}}
{{- fail "loraplex.model is not set: name the checkpoint folder inside the image or under modelVolume.mountPath" -}}
{{- end -}}
{{- if not $app.artifact_root -}}
{{- fail "loraplex.artifact_root is not set: it is where the artifacts volume is mounted, e.g. /mnt/loraplex/artifacts" -}}
{{- end -}}
{{- if not (hasPrefix "/" $app.artifact_root) -}}
{{- fail (printf "loraplex.artifact_root must be an absolute path (it is a mount path), got %q" $app.artifact_root) -}}
{{- end -}}
{{- $http := $app.http | default dict -}}
{{- if ne ($http.host | default "127.0.0.1") "0.0.0.0" -}}
{{- fail (printf "loraplex.http.host must be 0.0.0.0 on Kubernetes (the router Service reaches the Serve proxies from outside their pods), got %q" ($http.host | default "127.0.0.1")) -}}
{{- end -}}
{{- $replicas := $app.replicas | default dict -}}
{{- $tp := $replicas.tp | default 1 | float64 -}}
{{- $gpus := $replicas.num_gpus | default 0 | float64 -}}
{{- if and (ne $gpus 0.0) (ne $gpus $tp) -}}
{{- fail (printf "loraplex.replicas.num_gpus must be 0 (CPU serving) or tp (%v): a replica holds one GPU per tensor-parallel rank, got %v" $tp $gpus) -}}
{{- end -}}
{{- if hasKey .Values.workers.resources "limits" -}}
{{- if hasKey .Values.workers.resources.limits .Values.workers.gpuResource -}}
{{- fail (printf "workers.resources.limits must not name %s: each worker's GPUs are loraplex.replicas.num_gpus (= tp)" .Values.workers.gpuResource) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.ingress.tlsSecret (not .Values.ingress.host) -}}
{{- fail "ingress.tlsSecret needs ingress.host: a certificate is for a host name" -}}
{{- end -}}
{{- end -}}

{{/* The Serve app's args: the loraplex section with the etcd wiring filled in. */}}
{{- define "loraplex.appArgs" -}}
{{- $args := deepCopy .Values.loraplex -}}
{{- $etcd := deepCopy ($args.etcd | default dict) -}}
{{- $_ := set $etcd "endpoints" (include "loraplex.etcdEndpoints" . | fromJsonArray) -}}
{{- if .Values.etcd.external.tlsSecret -}}
{{- $dir := include "loraplex.etcdTLSDir" . -}}
{{- $_ := set $etcd "ca_cert" (printf "%s/ca.crt" $dir) -}}
{{- $_ := set $etcd "cert" (printf "%s/tls.crt" $dir) -}}
{{- $_ := set $etcd "key" (printf "%s/tls.key" $dir) -}}
{{- end -}}
{{- $_ := set $args "etcd" $etcd -}}
{{- toYaml $args -}}
{{- end -}}

{{/* A Ray Serve config file, shaped as LoraplexConfig.to_serve_config() writes it. */}}
{{- define "loraplex.serveConfig" -}}
{{- $http := .Values.loraplex.http -}}
{{- $app := dict "name" "loraplex" "route_prefix" "/" "import_path" "loraplex.cluster.app:build_app" "args" (include "loraplex.appArgs" . | fromYaml) -}}
{{- $serve := dict "proxy_location" "EveryNode" "http_options" (dict "host" $http.host "port" $http.port) "applications" (list $app) -}}
{{- toYaml $serve -}}
{{- end -}}

{{/* A Ray pod template: head and workers differ in container name, ports, resources and
scheduling; env (admin key), volumes and labels are the same on both. Called with
(dict "root" $ "container" NAME "group" .Values.head|workers "resources" R "ports" LIST). */}}
{{- define "loraplex.rayPodTemplate" -}}
{{- $root := .root -}}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "loraplex.labels" $root | nindent 4 }}
    app.kubernetes.io/component: ray
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "loraplex.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      env:
        - name: {{ $root.Values.loraplex.auth.admin_key_env | default "LORAPLEX_ADMIN_KEY" }}
          valueFrom:
            secretKeyRef:
              name: {{ include "loraplex.adminKeySecret" $root }}
              key: {{ $root.Values.adminKey.secretKey }}
        - name: {{ $root.Values.loraplex.auth.metrics_key_env | default "LORAPLEX_METRICS_KEY" }}
          valueFrom:
            secretKeyRef:
              name: {{ include "loraplex.metricsKeySecret" $root }}
              key: {{ $root.Values.metricsKey.secretKey }}
        {{- /* Ray reads its ingress proxy from the environment Ray starts in
        (cluster/ingress_proxy.py) */}}
        {{- $direct := ternary "1" "0" (eq ($root.Values.loraplex.http.ingress_proxy | default "serve") "haproxy") }}
        - name: RAY_SERVE_ENABLE_DIRECT_INGRESS
          value: {{ $direct | quote }}
        - name: RAY_SERVE_ENABLE_HA_PROXY
          value: {{ $direct | quote }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      volumeMounts:
        - name: artifacts
          mountPath: {{ $root.Values.loraplex.artifact_root }}
        - name: dshm
          mountPath: /dev/shm
        {{- if $root.Values.modelVolume.existingClaim }}
        - name: model
          mountPath: {{ $root.Values.modelVolume.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $root.Values.etcd.external.tlsSecret }}
        - name: etcd-tls
          mountPath: {{ include "loraplex.etcdTLSDir" $root }}
          readOnly: true
        {{- end }}
  volumes:
    - name: artifacts
      persistentVolumeClaim:
        claimName: {{ include "loraplex.artifactsClaim" $root }}
    - name: dshm
      emptyDir:
        medium: Memory
    {{- if $root.Values.modelVolume.existingClaim }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $root.Values.modelVolume.existingClaim }}
        readOnly: true
    {{- end }}
    {{- if $root.Values.etcd.external.tlsSecret }}
    - name: etcd-tls
      secret:
        secretName: {{ $root.Values.etcd.external.tlsSecret }}
        defaultMode: 0400
    {{- end }}
{{- end -}}
