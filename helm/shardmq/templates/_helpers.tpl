{{/* Names, labels and the derived settings every template shares. */}}

{{- define "shardmq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardmq.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "shardmq.headless" -}}
{{- printf "%s-headless" (include "shardmq.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardmq.etcdName" -}}
{{- printf "%s-etcd" (include "shardmq.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardmq.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "shardmq.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "shardmq.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardmq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: broker
{{- end -}}

{{- define "shardmq.etcdSelectorLabels" -}}
app.kubernetes.io/name: {{ include "shardmq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: etcd
{{- end -}}

{{- define "shardmq.etcdLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "shardmq.etcdSelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "shardmq.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shardmq.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "shardmq.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* A cluster when more than one node; a standalone node needs no etcd. */}}
{{- define "shardmq.clustered" -}}
{{- if gt (int .Values.replicaCount) 1 -}}true{{- end -}}
{{- end -}}

{{/* The bundled etcd runs only for a cluster without external endpoints. */}}
{{- define "shardmq.etcdBundled" -}}
{{- if and (include "shardmq.clustered" .) .Values.etcd.bundled (empty .Values.etcd.endpoints) -}}true{{- end -}}
{{- end -}}

{{/* Comma list of etcd client endpoints: the external ones, or every bundled member by DNS name. */}}
{{- define "shardmq.etcdEndpoints" -}}
{{- if .Values.etcd.endpoints -}}
{{- join "," .Values.etcd.endpoints -}}
{{- else -}}
{{- $name := include "shardmq.etcdName" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicaCount) -}}
{{- $eps = append $eps (printf "%s-%d.%s-headless.%s.svc:2379" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- join "," $eps -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding default-pass and cluster-secret. */}}
{{- define "shardmq.secretName" -}}
{{- include "shardmq.fullname" . -}}
{{- end -}}

{{- define "shardmq.tlsSecretName" -}}
{{- if .Values.tls.existingSecret -}}
{{- .Values.tls.existingSecret -}}
{{- else -}}
{{- printf "%s-tls" (include "shardmq.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
A generated value that stays the same across upgrades: the given one, else what the release's
Secret already holds (lookup; empty under `helm template`), else a new random one.
Call with (dict "ctx" $ "key" "cluster-secret" "given" .Values.cluster.secret).
*/}}
{{- define "shardmq.stableSecret" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace (include "shardmq.secretName" .ctx) | default dict -}}
{{- $old := dig "data" .key "" $existing -}}
{{- if .given -}}
{{- .given -}}
{{- else if $old -}}
{{- $old | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{/* Client listeners: name, port, whether on. */}}
{{- define "shardmq.clientPorts" -}}
{{- $l := .Values.listeners -}}
{{- $ports := list (dict "name" "amqp" "port" $l.amqp) -}}
{{- if .Values.tls.enabled -}}
{{- $ports = append $ports (dict "name" "amqps" "port" $l.amqps) -}}
{{- end -}}
{{- if $l.mqtt -}}
{{- $ports = append $ports (dict "name" "mqtt" "port" $l.mqtt) -}}
{{- if .Values.tls.enabled -}}
{{- $ports = append $ports (dict "name" "mqtts" "port" $l.mqtts) -}}
{{- end -}}
{{- end -}}
{{- if $l.ws -}}
{{- $ports = append $ports (dict "name" "ws" "port" $l.ws) -}}
{{- end -}}
{{- $ports = append $ports (dict "name" "http" "port" $l.http) -}}
{{- $ports = append $ports (dict "name" "metrics" "port" $l.prometheus) -}}
{{- if .Values.tls.enabled -}}
{{- $ports = append $ports (dict "name" "metrics-tls" "port" $l.prometheusTls) -}}
{{- end -}}
{{- toJson $ports -}}
{{- end -}}

{{- define "shardmq.validate" -}}
{{- if and (include "shardmq.clustered" .) (not .Values.etcd.bundled) (empty .Values.etcd.endpoints) -}}
{{- fail "replicaCount > 1 is a cluster and needs etcd: set etcd.bundled=true or etcd.endpoints" -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- if not (or .Values.tls.existingSecret .Values.tls.certManager.enabled (and .Values.tls.cert .Values.tls.key)) -}}
{{- fail "tls.enabled needs tls.existingSecret, tls.certManager.enabled or tls.cert and tls.key" -}}
{{- end -}}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.certManager.issuerRef.name) -}}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name" -}}
{{- end -}}
{{- end -}}
{{- end -}}
