{{/*
One entry of RayService.spec.rayClusterConfig.workerGroupSpecs: a GPU worker group whose pods
each run the Ray worker, the cache gRPC sidecar (one per node) and, when the checkpoint is
downloaded, an init container copying it to a per-pod volume.
Takes (dict "root" $ "group" oneOfValues.workerGroups); keys a group leaves out take the
defaults of deploy/chart_values.py's WorkerGroup (a -f file's workerGroups list replaces the
chart's, so its groups carry no defaults from values.yaml).
*/}}
{{- define "moe.workerGroup" -}}
{{- $root := .root -}}
{{- $g := merge (dict) .group (dict "gpuResource" "nvidia.com/gpu" "cpu" "16" "memory" "128Gi" "sharedMemory" "64Gi") -}}
{{- $v := $root.Values -}}
{{- $ms := $v.modelStorage -}}
- groupName: {{ $g.name }}
  replicas: {{ $g.replicas }}
  minReplicas: {{ kindIs "invalid" $g.minReplicas | ternary $g.replicas $g.minReplicas }}
  maxReplicas: {{ kindIs "invalid" $g.maxReplicas | ternary $g.replicas $g.maxReplicas }}
  numOfHosts: 1
  {{- if $g.idleTimeoutSeconds }}
  idleTimeoutSeconds: {{ $g.idleTimeoutSeconds }}
  {{- end }}
  rayStartParams:
    {{- include "moe.rayStartCommon" $root | nindent 4 }}
    {{- $roleResources := include "moe.roleResources" $g }}
    {{- range $k, $val := $g.rayStartParams }}
    {{- if not (and $roleResources (eq $k "resources")) }}
    {{ $k }}: {{ $val | quote }}
    {{- end }}
    {{- end }}
    {{- with $roleResources }}
    resources: {{ . | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "moe.rayPodLabels" $root | nindent 8 }}
        app.kubernetes.io/component: ray-worker
        moe.io/worker-group: {{ $g.name }}
        moe.io/role: {{ default "any" $g.role }}
    spec:
      {{- include "moe.podCommon" (dict "root" $root "place" $g) | nindent 6 }}
      {{- if eq $ms.source "download" }}
      initContainers:
        - name: model-download
          image: {{ include "moe.imageRef" $ms.download.image }}
          imagePullPolicy: {{ $ms.download.image.pullPolicy }}
          {{- if $ms.download.command }}
          command:
            {{- toYaml $ms.download.command | nindent 12 }}
          {{- else }}
          command: ["rclone", "copy", "--transfers=32", "--checkers=64", "--config=/tmp/rclone.conf", {{ $ms.download.uri | quote }}, {{ $v.serve.model.path | quote }}]
          {{- end }}
          env:
            - name: HOME
              value: /tmp
          {{- with $ms.download.credentialsSecret }}
          envFrom:
            - secretRef:
                name: {{ . }}
          {{- end }}
          securityContext:
            {{- include "moe.containerSecurityContext" $root | nindent 12 }}
          resources:
            requests: {cpu: "4", memory: 8Gi}
            limits: {cpu: "16", memory: 16Gi}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            - {name: model, mountPath: {{ $ms.mountPath }}}
      {{- end }}
      containers:
        - name: ray-worker
          {{- include "moe.rayContainerCommon" $root | nindent 10 }}
          {{- if eq (include "moe.redisHasPassword" $root) "true" }}
            - name: MOE_REDIS_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: {{ include "moe.redisSecret" $root }}
                  key: {{ $v.redis.auth.secretKey }}
          {{- end }}
          resources:
            requests:
              cpu: {{ $g.cpu | quote }}
              memory: {{ $g.memory | quote }}
              {{- if gt (int $g.gpusPerPod) 0 }}
              {{ $g.gpuResource }}: {{ $g.gpusPerPod }}
              {{- end }}
            limits:
              cpu: {{ $g.cpu | quote }}
              memory: {{ $g.memory | quote }}
              {{- if gt (int $g.gpusPerPod) 0 }}
              {{ $g.gpuResource }}: {{ $g.gpusPerPod }}
              {{- end }}
          ports:
            - {name: metrics, containerPort: {{ $v.metrics.port }}}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            - {name: dshm, mountPath: /dev/shm}
            - {name: model, mountPath: {{ $ms.mountPath }}, readOnly: true}
        {{- if $v.cacheServer.enabled }}
        {{- include "moe.cacheSidecar" $root | nindent 8 }}
        {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $g.sharedMemory | quote }}
        {{- include "moe.modelVolume" $root | nindent 8 }}
        {{- if $v.cacheServer.enabled }}
        - name: cache-disk
          emptyDir: {}
        {{- with $v.cacheServer.tlsSecret }}
        - name: cache-tls
          secret:
            secretName: {{ . }}
        {{- end }}
        {{- end }}
{{- end -}}

{{/* The model volume of a worker pod, by modelStorage.source. */}}
{{- define "moe.modelVolume" -}}
{{- $ms := .Values.modelStorage -}}
- name: model
{{- if eq $ms.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" (include "moe.fullname" .)) $ms.pvc.existingClaim }}
    readOnly: true
{{- else if eq $ms.source "hostPath" }}
  hostPath:
    path: {{ $ms.hostPath.path }}
    type: {{ $ms.hostPath.type }}
{{- else }}
  ephemeral:
    volumeClaimTemplate:
      metadata:
        labels:
          {{- include "moe.selectorLabels" . | nindent 10 }}
      spec:
        accessModes: [ReadWriteOnce]
        {{- with $ms.download.storageClass }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $ms.download.size | quote }}
{{- end }}
{{- end -}}

{{/* The cache gRPC server beside the Ray worker (`moectl cache serve`). */}}
{{- define "moe.cacheSidecar" -}}
{{- $c := .Values.cacheServer -}}
- name: cache-server
  image: {{ include "moe.imageRef" .Values.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["moectl", "cache", "serve"]
  args:
    - --host=0.0.0.0
    - --port={{ $c.port }}
    - --host-bytes={{ $c.hostBytes }}
    - --namespace={{ .Values.serve.cache.namespace }}
    - --eviction={{ $c.eviction }}
    {{- if ne .Values.redis.mode "none" }}
    - --redis-bytes={{ $c.redisBytes }}
    {{- end }}
    {{- if ne (toString $c.diskBytes) "0" }}
    - --disk=/cache
    - --disk-bytes={{ $c.diskBytes }}
    {{- end }}
    {{- if $c.tlsSecret }}
    - --tls-cert=/etc/moe/cache-tls/tls.crt
    - --tls-key=/etc/moe/cache-tls/tls.key
    {{- end }}
  env:
    {{- include "moe.cacheSecretEnv" . | nindent 4 }}
    {{- if eq (include "moe.redisHasPassword" .) "true" }}
    - name: MOE_REDIS_PASSWORD
      valueFrom:
        secretKeyRef:
          name: {{ include "moe.redisSecret" . }}
          key: {{ .Values.redis.auth.secretKey }}
    {{- end }}
    {{- if ne .Values.redis.mode "none" }}
    - name: MOE_CACHE_REDIS_URL
      value: {{ include "moe.redisUrl" . | quote }}
    {{- end }}
  securityContext:
    {{- include "moe.containerSecurityContext" . | nindent 4 }}
  resources:
    requests:
      cpu: {{ $c.cpu | quote }}
      memory: {{ $c.memory | quote }}
    limits:
      cpu: {{ $c.cpu | quote }}
      memory: {{ $c.memory | quote }}
  ports:
    - {name: cache-grpc, containerPort: {{ $c.port }}}
  readinessProbe:
    tcpSocket:
      port: cache-grpc
    periodSeconds: 10
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: cache-disk, mountPath: /cache}
    {{- if $c.tlsSecret }}
    - {name: cache-tls, mountPath: /etc/moe/cache-tls, readOnly: true}
    {{- end }}
{{- end -}}

{{/*
The `ray start --resources` value of a role group's pods in KubeRay's format ("{\"k\":v}"):
the group's own rayStartParams.resources plus 1000 units of `moe.io/<role>`, which only that
pool's deployment asks for (deploy/chart_roles.py); empty for role `any`. Takes a worker group.
*/}}
{{- define "moe.roleResources" -}}
{{- $role := default "any" .role -}}
{{- if ne $role "any" -}}
{{- $res := dict -}}
{{- with (index (default (dict) .rayStartParams) "resources") -}}
{{- $res = . | trimPrefix "\"" | trimSuffix "\"" | replace "\\" "" | fromJson -}}
{{- end -}}
{{- $_ := set $res (printf "moe.io/%s" $role) 1000 -}}
{{- printf "\"%s\"" (toJson $res | replace "\"" "\\\"") -}}
{{- end -}}
{{- end -}}

{{/*
Role groups and pools agree (deploy/chart_roles.py check_roles holds the full rules, with the GPU
counts; this guard stops `helm install` without `moectl deploy render` from placing a pool on
the wrong groups, or nowhere).
*/}}
{{- define "moe.checkRoles" -}}
{{- $dis := default (dict) .Values.serve.disaggregation -}}
{{- $roles := dict -}}
{{- range $g := .Values.workerGroups -}}
{{- $_ := set $roles (default "any" $g.role) true -}}
{{- end -}}
{{- $hasRoles := or (hasKey $roles "prefill") (hasKey $roles "decode") -}}
{{- if and $hasRoles (not $dis.enabled) -}}
{{- fail "workerGroups[].role prefill/decode needs serve.disaggregation.enabled" -}}
{{- end -}}
{{- if $dis.enabled -}}
{{- range $role := list "prefill" "decode" -}}
{{- $key := printf "moe.io/%s" $role -}}
{{- $asks := (default (dict) (index (default (dict) (index $dis $role)) "resources")) -}}
{{- if and $hasRoles (not (hasKey $roles $role)) -}}
{{- fail (printf "workerGroups: no group has role %s; with role groups each pool needs its own" $role) -}}
{{- end -}}
{{- if and $hasRoles (not (hasKey $asks $key)) -}}
{{- fail (printf "serve.disaggregation.%s.resources must ask %s (moectl deploy render writes it)" $role $key) -}}
{{- end -}}
{{- $other := printf "moe.io/%s" (eq $role "prefill" | ternary "decode" "prefill") -}}
{{- if hasKey $asks $other -}}
{{- fail (printf "serve.disaggregation.%s.resources asks %s: %s replicas would land on the other pool's groups" $role $other $role) -}}
{{- end -}}
{{- if and (not $hasRoles) (hasKey $asks $key) -}}
{{- fail (printf "serve.disaggregation.%s.resources asks %s but no worker group has role %s" $role $key $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
