{{/*
The Ray Serve config (ServeDeploySchema) of the RayService's serveConfigV2, built from
.Values.serve exactly as deploy/config.py's to_serve_config() builds it from the same serve YAML
(a test renders both and compares them). Keys absent from values take Serve's defaults.
With serve.disaggregation.enabled the model is two fixed-size pools, PrefillServer and
DecodeServer, in that order (deploy.config.model_deployments), instead of the autoscaled
ModelServer.
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
{{- $maxOngoing := default 64 $engine.max_ongoing_requests -}}
{{- /* deploy/config.py SHUTDOWN_POLL_S: a stopped replica checks for running requests this often */ -}}
{{- $poll := 0.5 -}}
{{- $ingress := dict "name" "OpenAIIngress" "max_ongoing_requests" 1024 "graceful_shutdown_wait_loop_s" $poll -}}
{{- /* deploy/config.py HttpSection.replicas: with engine.device auto and no http.ingress_replicas,
build_app counts the cluster's GPUs (GPU_INGRESS_REPLICAS in front of CUDA, one on the CPU) */ -}}
{{- $device := default "auto" $engine.device -}}
{{- if $http.ingress_replicas -}}
{{- $_ := set $ingress "num_replicas" $http.ingress_replicas -}}
{{- else if ne $device "auto" -}}
{{- $_ := set $ingress "num_replicas" (eq $device "cuda" | ternary 4 1) -}}
{{- end -}}
{{- $deployments := list $ingress -}}
{{- $router := include "moe.requestRouter" . | fromYaml -}}
{{- $dis := default (dict) $s.disaggregation -}}
{{- if $dis.enabled -}}
{{- range $pair := list (list "prefill" "PrefillServer") (list "decode" "DecodeServer") -}}
{{- $name := last $pair -}}
{{- $pool := default (dict) (index $dis (first $pair)) -}}
{{- $options := dict "num_cpus" (kindIs "invalid" $pool.num_cpus | ternary 1.0 $pool.num_cpus) -}}
{{- if $pool.resources -}}
{{- $_ := set $options "resources" $pool.resources -}}
{{- end -}}
{{- $d := dict "name" $name "num_replicas" (default 1 $pool.replicas) "max_ongoing_requests" $maxOngoing "graceful_shutdown_wait_loop_s" $poll "ray_actor_options" $options -}}
{{- if $router -}}
{{- $_ := set $d "request_router_config" $router -}}
{{- end -}}
{{- $deployments = append $deployments $d -}}
{{- end -}}
{{- else -}}
{{- $model := dict "name" "ModelServer" "autoscaling_config" $scaling "max_ongoing_requests" $maxOngoing "graceful_shutdown_wait_loop_s" $poll "ray_actor_options" (dict "num_cpus" (kindIs "invalid" $engine.num_cpus | ternary 1.0 $engine.num_cpus)) -}}
{{- if $router -}}
{{- $_ := set $model "request_router_config" $router -}}
{{- end -}}
{{- $deployments = append $deployments $model -}}
{{- end -}}
{{- $app := dict "name" (default "moe" $s.app_name) "route_prefix" (default "/" $http.route_prefix) "import_path" "deploy.app:build_app" "args" $s "deployments" $deployments -}}
{{- $config := dict "proxy_location" "HeadOnly" "http_options" (dict "host" (default "127.0.0.1" $http.host) "port" (default 8000 $http.port)) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}

{{/*
The model deployments' request_router_config by serve.routing.policy (deploy.config's
request_router_config and ROUTER_IMPORT_PATHS), as YAML; empty for power_of_two, Serve's own.
Only prefix_aware takes kwargs (its tolerance, the block size and, with engine.num_blocks, the
KV capacity in blocks).
*/}}
{{- define "moe.requestRouter" -}}
{{- $r := default (dict) .Values.serve.routing -}}
{{- $engine := default (dict) .Values.serve.engine -}}
{{- $paths := dict "prefix_aware" "deploy.routing:PrefixAwareRouter" "round_robin" "deploy.routing:RoundRobinRouter" -}}
{{- $path := index $paths (default "power_of_two" $r.policy) -}}
{{- if $path -}}
{{- $kwargs := dict -}}
{{- if eq $r.policy "prefix_aware" -}}
{{- $kwargs = dict "imbalance_tolerance" (kindIs "invalid" $r.imbalance_tolerance | ternary 4 $r.imbalance_tolerance) "block_size" (default 16 $engine.block_size) -}}
{{- if not (kindIs "invalid" $engine.num_blocks) -}}
{{- $_ := set $kwargs "capacity_blocks" $engine.num_blocks -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "request_router_class" $path "request_router_kwargs" $kwargs "request_routing_stats_period_s" 1.0) -}}
{{- end -}}
{{- end -}}
