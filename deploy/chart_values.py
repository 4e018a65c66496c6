"""The Helm chart's values as a pydantic model, the chart's values.schema.json generated from it,
and the values that make the chart's GPU requests equal a placement Plan's.

    image, imagePullSecrets, serviceAccount, security    the pods
    serve                  deploy.config.ServeConfig itself (rendered into serveConfigV2)
    head, workerGroups     the RayService's head and GPU worker groups
    autoscaling, upgrade   in-tree autoscaler and the RayService upgrade strategy
    rayAuth, apiKey        Ray's cluster token and the OpenAI API key, both from Secrets
    redis, cacheServer     the Redis tier (in-cluster StatefulSet or external) and the cache sidecar
    modelStorage           where the checkpoint comes from: a PVC, a hostPath or a download step
    metrics, serviceMonitor, grafanaDashboard, networkPolicy

`serve` embeds deploy's own model, so the schema of the chart and the serve YAML cannot drift:
`schema()` regenerates values.schema.json and a test fails on any difference with the file.
`values_from_plan(plan, base)` returns `base` with worker groups whose GPUs sum to the plan's
(replicas x GPUs per replica) and a serve section asking for the plan's degrees; a disaggregated
serve section gets one worker group per role instead (deploy/chart_roles.py).
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.errors import InputError
from deploy.config import DEMO_MODEL, ServeConfig

CHART_DIR = Path(__file__).resolve().parents[1] / "helm" / "moe-orchestrator"
SCHEMA_FILE = CHART_DIR / "values.schema.json"
VALUES_FILE = CHART_DIR / "values.yaml"
GPU_RESOURCE = "nvidia.com/gpu"

_QUANTITY = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkKMGTPE]i?)?$"
_SIZE = r"^\s*[0-9]+(\.[0-9]*)?\s*([KMGTkmgt]([Ii]?[Bb])?|[Bb])?\s*$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Quantity = Annotated[str, StringConstraints(pattern=_QUANTITY)] | Annotated[int, Field(ge=0)]
"""A Kubernetes quantity: 16, "500m", "64Gi"."""
DnsLabel = Annotated[str, StringConstraints(pattern=_DNS_LABEL, max_length=40)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Image(_Strict):
    repository: str = Field(min_length=1)
    """Registry and name, e.g. ghcr.io/example/moe-orchestrator."""
    tag: str = Field(pattern=r"^[\w][\w.-]{0,127}$", json_schema_extra={"not": {"const": "latest"}})
    """A pinned tag (never `latest`)."""

    @field_validator("tag")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if v == "latest":
            raise ValueError("tag 'latest' is not pinned: give a version")
        return v

    digest: str = Field(default="", pattern=r"^(sha256:[0-9a-f]{64})?$")
    """Optional sha256 digest; when set it wins over the tag."""
    pullPolicy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"


class LocalRef(_Strict):
    name: str = Field(min_length=1)


class ServiceAccount(_Strict):
    create: bool = True
    name: str = ""
    """Default: the release's full name."""
    annotations: dict[str, str] = {}


class Security(_Strict):
    runAsUser: int = Field(default=1000, ge=1)
    """Non-root uid of the image's `ray` user."""
    runAsGroup: int = Field(default=1000, ge=1)
    fsGroup: int = Field(default=1000, ge=1)
    readOnlyRootFilesystem: bool = True
    """Ray writes only under /tmp (an emptyDir), so the root filesystem can be read-only."""


class PodPlacement(_Strict):
    nodeSelector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    affinity: dict[str, Any] = {}


class Head(PodPlacement):
    cpu: Quantity = "8"
    memory: Quantity = "32Gi"
    rayStartParams: dict[str, str] = {}
    """Extra `ray start` flags; num-cpus 0 keeps model replicas off the head."""


class WorkerGroup(PodPlacement):
    name: DnsLabel
    """Group name (a DNS label)."""
    replicas: int = Field(ge=0)
    """Pods at start; one pod per node for whole-node GPU groups."""
    minReplicas: int | None = Field(default=None, ge=0)
    """Autoscaler floor; default: replicas."""
    maxReplicas: int | None = Field(default=None, ge=0)
    """Autoscaler ceiling; default: replicas."""
    gpusPerPod: int = Field(ge=0)
    """GPUs of one pod (its container's request and limit)."""
    gpuResource: str = GPU_RESOURCE
    cpu: Quantity = "16"
    memory: Quantity = "128Gi"
    sharedMemory: Quantity = "64Gi"
    """Size of the memory-backed /dev/shm (NCCL and Ray's object store use it)."""
    rayStartParams: dict[str, str] = {}
    idleTimeoutSeconds: int | None = Field(default=None, ge=0)
    role: Literal["any", "prefill", "decode"] = "any"
    """`prefill` / `decode`: the pods advertise the Ray resource `moe.io/<role>` and only that
    pool of a disaggregated deployment asks for it (deploy/chart_roles.py); `any`: no role."""

    @model_validator(mode="after")
    def _bounds(self) -> WorkerGroup:
        low = self.replicas if self.minReplicas is None else self.minReplicas
        high = self.replicas if self.maxReplicas is None else self.maxReplicas
        if not low <= self.replicas <= high:
            raise ValueError(
                f"worker group {self.name}: replicas={self.replicas} outside "
                f"[minReplicas={low}, maxReplicas={high}]"
            )
        return self


class Autoscaling(_Strict):
    enabled: bool = True
    """KubeRay's in-tree autoscaler: worker pods follow Serve's replica demand."""
    upscalingMode: Literal["Default", "Conservative", "Aggressive"] = "Default"
    idleTimeoutSeconds: int = Field(default=600, ge=0)
    cpu: Quantity = "500m"
    memory: Quantity = "512Mi"


class Upgrade(_Strict):
    strategy: Literal["None", "NewCluster", "NewClusterWithIncrementalUpgrade"] = "None"
    """RayService.spec.upgradeStrategy.type; serveConfigV2-only changes are applied in place
    under every strategy. NewCluster needs twice the GPUs during a cluster change."""
    gatewayClassName: str = ""
    stepSizePercent: int = Field(default=25, ge=1, le=100)
    intervalSeconds: int = Field(default=60, ge=1)
    maxSurgePercent: int = Field(default=25, ge=0, le=100)

    @model_validator(mode="after")
    def _gateway(self) -> Upgrade:
        if self.strategy == "NewClusterWithIncrementalUpgrade" and not self.gatewayClassName:
            raise ValueError("upgrade.gatewayClassName is required by the incremental upgrade")
        return self


class SecretRef(_Strict):
    existingSecret: str = ""
    """Name of a Secret you created; empty = the chart creates one (kept across upgrades)."""


class RayAuth(SecretRef):
    enabled: bool = True
    """Ray token authentication (authOptions.mode: token); the key is `auth_token`."""


class ApiKey(SecretRef):
    secretKey: str = "api-key"
    """Key inside the Secret; exposed as the variable named by serve.http.api_key_env."""


class CacheSecret(SecretRef):
    secretKey: str = "cache-secret"
    """Key inside the Secret; exposed as MOE_CACHE_SECRET to every Ray container and cache
    sidecar (block keys and the MAC of blocks in Redis: the same value everywhere)."""


class Persistence(_Strict):
    enabled: bool = True
    size: Quantity = "64Gi"
    storageClass: str | None = None


class ExternalRedis(_Strict):
    host: str = ""
    port: int = Field(default=6379, ge=1, le=65535)
    db: int = Field(default=0, ge=0)
    tls: bool = False


class Redis(_Strict):
    mode: Literal["internal", "external", "none"] = "internal"
    image: Image = Image(repository="docker.io/library/redis", tag="8.2.1-alpine")
    maxmemory: str = Field(default="48gb", pattern=r"^[0-9]+(b|kb|mb|gb)?$")
    cpu: Quantity = "2"
    memory: Quantity = "56Gi"
    persistence: Persistence = Persistence()
    external: ExternalRedis = ExternalRedis()
    auth: ApiKey = ApiKey(secretKey="redis-password")
    """The password: an existing Secret, or one the chart creates for the internal Redis."""
    placement: PodPlacement = PodPlacement()

    @model_validator(mode="after")
    def _external(self) -> Redis:
        if self.mode == "external" and not self.external.host:
            raise ValueError("redis.external.host is required when redis.mode is external")
        return self


class CacheServer(_Strict):
    enabled: bool = True
    """Run `moectl cache serve` beside the Ray worker in every GPU pod (one per node)."""
    port: int = Field(default=50051, ge=1, le=65535)
    hostBytes: Annotated[str, StringConstraints(pattern=_SIZE)] = "64G"
    redisBytes: Annotated[str, StringConstraints(pattern=_SIZE)] = "32G"
    diskBytes: Annotated[str, StringConstraints(pattern=_SIZE)] = "0"
    """Disk tier on an emptyDir at /cache; 0 = none."""
    eviction: Literal["lru", "attention"] = "lru"
    cpu: Quantity = "4"
    memory: Quantity = "80Gi"
    tlsSecret: str = ""
    """A kubernetes.io/tls Secret; when set the gRPC port serves TLS."""


class PvcSource(_Strict):
    existingClaim: str = ""
    """A claim holding the checkpoint; empty = the chart creates one (ReadOnlyMany)."""
    size: Quantity = "2Ti"
    storageClass: str | None = None
    accessModes: list[Literal["ReadOnlyMany", "ReadWriteMany", "ReadWriteOnce"]] = ["ReadOnlyMany"]


class HostPathSource(_Strict):
    path: str = Field(default="/mnt/models", pattern=r"^/")
    type: Literal["Directory", "DirectoryOrCreate"] = "Directory"


class DownloadSource(_Strict):
    uri: str = ""
    """Object-storage location, e.g. s3://bucket/deepseek-v3 (rclone remote syntax :s3:...)."""
    image: Image = Image(repository="docker.io/rclone/rclone", tag="1.71.0")
    command: list[str] = []
    """Default: rclone copy of uri into the mount path with 32 parallel transfers."""
    credentialsSecret: str = ""
    """A Secret whose keys become the download container's environment."""
    size: Quantity = "2Ti"
    """Size of the per-pod ephemeral volume the checkpoint is copied to."""
    storageClass: str | None = None
    """Storage class of that volume (local NVMe is best)."""


class ModelStorage(_Strict):
    source: Literal["pvc", "hostPath", "download"] = "pvc"
    mountPath: str = Field(default="/models", pattern=r"^/")
    pvc: PvcSource = PvcSource()
    hostPath: HostPathSource = HostPathSource()
    download: DownloadSource = DownloadSource()

    @model_validator(mode="after")
    def _download(self) -> ModelStorage:
        if self.source == "download" and not self.download.uri:
            raise ValueError("modelStorage.download.uri is required when source is download")
        return self


class Metrics(_Strict):
    port: int = Field(default=8080, ge=1, le=65535)
    """Ray's metrics export port on every node."""


class ServiceMonitor(_Strict):
    enabled: bool = False
    """Needs the Prometheus operator's CRDs (monitoring.coreos.com/v1)."""
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m)$")
    labels: dict[str, str] = {}


class GrafanaDashboard(_Strict):
    enabled: bool = True
    labels: dict[str, str] = {"grafana_dashboard": "1"}


class NetworkPolicy(_Strict):
    enabled: bool = True
    """Redis and the worker pods (cache gRPC) accept traffic only from this release's pods."""
    metricsFrom: list[dict[str, Any]] = [{"namespaceSelector": {}}]
    """Peers allowed to scrape the metrics port of the worker pods."""


class ChartValues(_Strict):
    """The whole values.yaml."""

    nameOverride: str = ""
    fullnameOverride: str = ""
    image: Image
    imagePullSecrets: list[LocalRef] = []
    serviceAccount: ServiceAccount = ServiceAccount()
    security: Security = Security()
    rayVersion: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    serve: ServeConfig
    head: Head = Head()
    workerGroups: list[WorkerGroup] = Field(min_length=1)
    autoscaling: Autoscaling = Autoscaling()
    upgrade: Upgrade = Upgrade()
    rayAuth: RayAuth = RayAuth()
    cacheSecret: CacheSecret = CacheSecret()
    apiKey: ApiKey = ApiKey()
    redis: Redis = Redis()
    cacheServer: CacheServer = CacheServer()
    modelStorage: ModelStorage = ModelStorage()
    metrics: Metrics = Metrics()
    serviceMonitor: ServiceMonitor = ServiceMonitor()
    grafanaDashboard: GrafanaDashboard = GrafanaDashboard()
    networkPolicy: NetworkPolicy = NetworkPolicy()

    @model_validator(mode="after")
    def _consistent(self) -> ChartValues:
        path, mount = self.serve.model.path, self.modelStorage.mountPath.rstrip("/")
        if path != DEMO_MODEL and not path.startswith(mount + "/"):
            raise ValueError(
                f"serve.model.path {path!r} is not under modelStorage.mountPath {mount!r}"
            )
        names = [g.name for g in self.workerGroups]
        if len(set(names)) != len(names):
            raise ValueError(f"workerGroups names repeat: {names}")
        from deploy.chart_roles import check_roles

        check_roles(self)
        return self

    @property
    def gpus(self) -> int:
        """GPUs the worker groups request at their initial replica counts."""
        return sum(g.replicas * g.gpusPerPod for g in self.workerGroups)


def parse_values(data: Any, *, origin: str = "values") -> ChartValues:
    """Validate chart values; InputError with one line naming the field."""
    if not isinstance(data, dict):
        raise InputError(f"{origin}: expected a mapping at the top, got {type(data).__name__}")
    try:
        return ChartValues.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "<top>"
        msg = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("missing", "value_error") else f" (got {err.get('input')!r})"
        raise InputError(f"{origin}: {loc}: {msg}{got}") from None


def _widen_sizes(schema: dict[str, Any]) -> None:
    """Size fields of the serve config accept 512M / 8G strings (a before-validator turns them
    into bytes), which pydantic's schema cannot see; allow either form there."""
    sized = {"CacheTier": "bytes", "EngineSection": "kv_memory"}
    for model, field in sized.items():
        prop = schema["$defs"][model]["properties"][field]
        size = {"type": "string", "pattern": _SIZE}
        keep = {k: prop[k] for k in ("default", "title", "description") if k in prop}
        if "anyOf" in prop:  # optional: int | None
            prop.clear()
            prop.update(keep, anyOf=[{"type": "integer", "minimum": 0}, size, {"type": "null"}])
        else:
            prop.clear()
            prop.update(keep, anyOf=[{"type": "integer", "minimum": 0}, size])


def schema() -> dict[str, Any]:
    """values.schema.json (JSON Schema 2020-12) of ChartValues."""
    out = ChartValues.model_json_schema(mode="validation")
    _widen_sizes(out)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **out}


def schema_text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


def load_values_file(path: str | Path) -> dict[str, Any]:
    """A values YAML as a mapping; InputError (one line) for a missing file or bad YAML."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(f"{path}: cannot read the values file ({exc.strerror})") from None
    except yaml.YAMLError:
        raise InputError(f"{path}: is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping at the top, got {type(data).__name__}")
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of values: maps merge key by key, anything else replaces, null deletes."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def worker_shapes(plan) -> list[tuple[int, int]]:
    """[(GPUs per pod, pods)] of the whole deployment: one pod per node a replica uses.

    Replica 0's ranks are counted per node; the other replicas are assumed to repeat that shape
    on their own nodes (the planner lays replica k on the GPUs after replica k-1).
    """
    per_node = Counter(r.node for r in plan.ranks)
    shapes = Counter(per_node.values())
    return sorted(((gpus, n * plan.replicas) for gpus, n in shapes.items()), reverse=True)


def values_from_plan(
    plan, base_values: dict[str, Any], *, node_gpus: int | None = None
) -> dict[str, Any]:
    """`base_values` with worker groups and serve degrees taken from `plan` (a placement Plan).

    Step 1: one worker group per pod shape (GPUs per node of a replica), cloned from the base's
    first group so its node selector, tolerations and sizes carry over; min = max = replicas, so
    the GPUs requested are exactly plan.num_gpus x plan.replicas.
    Step 2: serve.plan asks for the plan's tp/pp/dp; Serve's model replicas are capped at the
    plan's replica count.
    With serve.disaggregation.enabled, step 1 is instead one group per role sized from that
    pool's layout and replicas (`chart_roles.size_role_groups`; plan.replicas is not used).
    """
    out = copy.deepcopy(base_values)
    if ((out.get("serve") or {}).get("disaggregation") or {}).get("enabled"):
        from deploy.chart_roles import size_role_groups

        out["serve"] = _serve_from_plan(plan, out["serve"])
        return size_role_groups(out, plan=plan, node_gpus=node_gpus)
    groups = out.get("workerGroups") or []
    template = dict(groups[0]) if groups else {"name": "gpu"}
    shapes = worker_shapes(plan)
    new_groups = []
    for gpus, pods in shapes:
        group = dict(template)
        if len(shapes) > 1:
            group["name"] = f"{template['name']}-{gpus}gpu"
        group.update(replicas=pods, minReplicas=pods, maxReplicas=pods, gpusPerPod=gpus)
        new_groups.append(group)
    out["workerGroups"] = new_groups
    out["serve"] = _serve_from_plan(plan, out.get("serve") or {})
    return out


def _serve_from_plan(plan, serve: dict[str, Any]) -> dict[str, Any]:
    """The serve section asking for the plan's degrees, model replicas capped at its replicas."""
    serve = copy.deepcopy(serve)
    d = plan.dims
    serve["plan"] = {"tp": d.tp, "pp": d.pp, "dp": d.dp}
    scaling = dict(serve.get("autoscaling") or {})
    scaling["max_replicas"] = plan.replicas
    scaling["min_replicas"] = min(int(scaling.get("min_replicas", 1)), plan.replicas)
    if scaling.get("initial_replicas") is not None:
        scaling["initial_replicas"] = min(int(scaling["initial_replicas"]), plan.replicas)
    serve["autoscaling"] = scaling
    return serve
