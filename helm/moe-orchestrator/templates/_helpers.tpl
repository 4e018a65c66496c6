{{/* Names. KubeRay appends suffixes to the RayService name, so the prefix stays short. */}}
{{- define "moe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "moe.fullname" -}}
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

{{- define "moe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "moe.labels" -}}
{{ include "moe.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Labels every Ray pod (head and workers) carries; Redis and the cache port admit only them. */}}
{{- define "moe.rayPodLabels" -}}
{{ include "moe.selectorLabels" . }}
moe.io/ray: "true"
{{- end -}}

{{/* image: repository:tag, or repository@digest when a digest is given. Takes an image map. */}}
{{- define "moe.imageRef" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{- define "moe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "moe.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "moe.rayAuthSecret" -}}
{{- default (printf "%s-ray-auth" (include "moe.fullname" .)) .Values.rayAuth.existingSecret -}}
{{- end -}}

{{- define "moe.cacheSecret" -}}
{{- default (printf "%s-cache-secret" (include "moe.fullname" .)) .Values.cacheSecret.existingSecret -}}
{{- end -}}

{{/* MOE_CACHE_SECRET from the chart's Secret (Ray containers and cache sidecars alike). */}}
{{- define "moe.cacheSecretEnv" -}}
- name: MOE_CACHE_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "moe.cacheSecret" . }}
      key: {{ .Values.cacheSecret.secretKey }}
{{- end -}}

{{- define "moe.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "moe.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}

{{- define "moe.redisSecret" -}}
{{- default (printf "%s-redis" (include "moe.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* Is there a Redis password Secret to read (created here or given)? */}}
{{- define "moe.redisHasPassword" -}}
{{- if or (eq .Values.redis.mode "internal") (and (eq .Values.redis.mode "external") .Values.redis.auth.existingSecret) -}}true{{- end -}}
{{- end -}}

{{/* The Redis URL of the cache sidecar; the password comes from $(MOE_REDIS_PASSWORD). */}}
{{- define "moe.redisUrl" -}}
{{- $auth := ternary ":$(MOE_REDIS_PASSWORD)@" "" (eq (include "moe.redisHasPassword" .) "true") -}}
{{- if eq .Values.redis.mode "internal" -}}
{{- printf "redis://%s%s-redis:6379/0" $auth (include "moe.fullname" .) -}}
{{- else -}}
{{- $e := .Values.redis.external -}}
{{- printf "%s://%s%s:%d/%d" (ternary "rediss" "redis" $e.tls) $auth $e.host (int $e.port) (int $e.db) -}}
{{- end -}}
{{- end -}}

{{/*
A Secret value that survives upgrades: the live Secret's value when `lookup` finds it, else a new
random one. Takes (dict "root" $ "name" secretName "key" dataKey).
*/}}
{{- define "moe.persistentSecretValue" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $live $live.data (hasKey $live.data .key) -}}
{{- index $live.data .key -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{- define "moe.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.security.runAsUser }}
runAsGroup: {{ .Values.security.runAsGroup }}
fsGroup: {{ .Values.security.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "moe.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .Values.security.readOnlyRootFilesystem }}
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Pod-level fields shared by the head and every worker group. Takes (dict "root" $ "place" map). */}}
{{- define "moe.podCommon" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "moe.serviceAccountName" $root }}
automountServiceAccountToken: false
securityContext:
  {{- include "moe.podSecurityContext" $root | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .place.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .place.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .place.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Environment of every Ray container: writable homes under /tmp, node name, secrets by reference. */}}
{{- define "moe.rayEnv" -}}
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: HF_HOME
  value: /tmp/cache/huggingface
- name: HF_HUB_OFFLINE
  value: "1"
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- /* Ray Serve's throughput mode with its HTTP proxy kept, as `moectl serve` sets
     (deploy/serve_cli.py SERVE_ENV; a test keeps the two equal) */}}
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: "1"
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "0"
- name: MOE_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{ include "moe.cacheSecretEnv" . }}
{{- with .Values.serve.http.api_key_env }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ include "moe.apiKeySecret" $ }}
      key: {{ $.Values.apiKey.secretKey }}
{{- end }}
{{- end -}}

{{/* Container fields shared by the head and the workers' Ray container. */}}
{{- define "moe.rayContainerCommon" -}}
image: {{ include "moe.imageRef" .Values.image }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- include "moe.containerSecurityContext" . | nindent 2 }}
env:
  {{- include "moe.rayEnv" . | nindent 2 }}
{{- end -}}

{{/* The Ray metrics port every node exports (scraped through the metrics Service). */}}
{{- define "moe.rayStartCommon" -}}
metrics-export-port: {{ .Values.metrics.port | quote }}
{{- end -}}
