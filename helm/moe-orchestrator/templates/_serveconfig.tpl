{{/*
The Ray Serve config (ServeDeploySchema) of the RayService's serveConfigV2, built from
.Values.serve exactly as deploy/config.py's to_serve_config() builds it from the same serve YAML
(a test renders both and compares them). Keys absent from values take Serve's defaults.
*/}}
{{- define "moe.serveConfig" -}}
{{- $s := .Values.serve -}}
{{- $a := default (dict) $s.autoscaling -}}
{{- $http := default (dict) $s.http -}}
{{- $engine := default (dict) $s.engine -}}
{{- $scaling := dict -}}
{{- range $k := list "min_replicas" "max_replicas" "target_ongoing_requests" "upscale_delay_s" "downscale_delay_s" "metrics_interval_s" "look_back_period_s" "initial_replicas" -}}
{{- if and (hasKey $a $k) (not (kindIs "invalid" (index $a $k))) -}}
{{- $_ := set $scaling $k (index $a $k) -}}
{{- end -}}
{{- end -}}
{{- if eq (default "engine" $a.policy) "engine" -}}
{{- $kwargs := dict -}}
{{- range $k := list "queue_depth_high" "kv_utilisation_high" "ttft_high_s" -}}
{{- if and (hasKey $a $k) (not (kindIs "invalid" (index $a $k))) -}}
{{- $_ := set $kwargs $k (index $a $k) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $scaling "policy" (dict "policy_function" "deploy.autoscaling:EngineSignalPolicy" "policy_kwargs" $kwargs) -}}
{{- end -}}
{{- $model := dict "name" "ModelServer" "autoscaling_config" $scaling "max_ongoing_requests" (default 64 $engine.max_ongoing_requests) "ray_actor_options" (dict "num_cpus" (kindIs "invalid" $engine.num_cpus | ternary 1.0 $engine.num_cpus)) -}}
{{- $ingress := dict "name" "OpenAIIngress" "num_replicas" 1 "max_ongoing_requests" 1024 -}}
{{- $app := dict "name" (default "moe" $s.app_name) "route_prefix" (default "/" $http.route_prefix) "import_path" "deploy.app:build_app" "args" $s "deployments" (list $ingress $model) -}}
{{- $config := dict "proxy_location" "HeadOnly" "http_options" (dict "host" (default "127.0.0.1" $http.host) "port" (default 8000 $http.port)) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}
