"""Worker groups per role for a disaggregated deployment (prefill and decode pools on their own GPUs).

A worker group has a `role`: `any` (the default: it serves whatever Ray places on it), `prefill`
or `decode`. The pods of a role group advertise a Ray custom resource named for the role,

    workerGroups[i].role: prefill   ->  ray start --resources='{"moe.io/prefill": 1000, ...}'

and each pool's Serve deployment asks for a little of it (`serve.disaggregation.prefill.resources:
{moe.io/prefill: 1}`), so prefill replicas land on prefill pods and decode replicas on decode pods,
each role with its own pod shape (gpusPerPod sized from that pool's layout). The capacity
(ROLE_RESOURCE_UNITS per pod) is far above what one pod's replicas ask, so the resource only
selects pods and never limits how many replicas share one.

The pool's resources are stated in the values, never added behind their back: serveConfigV2 is
`to_serve_config(values.serve)` exactly, and `check_roles` rejects role groups whose pool does
not ask for its role (`moectl deploy render` writes the request; `size_role_groups`).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from typing import Any

from cluster.errors import InputError

ROLES = ("prefill", "decode")
ROLE_RESOURCE_UNITS = 1000
"""Units of `moe.io/<role>` each pod of a role group advertises (the template writes the same)."""
POOL_RESOURCE_ASK = 1.0
"""Units of `moe.io/<role>` one replica of that pool asks for."""


def role_resource(role: str) -> str:
    """The Ray custom resource of a role: `moe.io/prefill`, `moe.io/decode`."""
    return f"moe.io/{role}"


def parse_ray_resources(text: str, field: str) -> dict[str, float]:
    """A `rayStartParams.resources` value in KubeRay's format (`"{\\"Custom\\": 1}"`: JSON with
    its quotes escaped, inside a pair of quotes) -> {name: units}; ValueError naming `field`.
    The format is read as Ray's KubeRay autoscaler reads it: outer quotes dropped, backslashes
    removed, JSON."""
    body = text.strip()
    if len(body) >= 2 and body[0] == body[-1] == '"':
        body = body[1:-1]
    try:
        data = json.loads(body.replace("\\", ""))
    except ValueError:
        raise ValueError(
            f'{field}={text!r} is not KubeRay\'s resources format "{{\\"name\\": units}}"'
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in data.values()
    ):
        raise ValueError(f"{field}={text!r}: expected a JSON object of numbers")
    return {str(k): float(v) for k, v in data.items()}


def format_ray_resources(resources: dict[str, float]) -> str:
    """{name: units} -> KubeRay's `rayStartParams.resources` string (keys sorted)."""
    body = json.dumps({k: resources[k] for k in sorted(resources)}, separators=(",", ":"))
    return '"' + body.replace('"', '\\"') + '"'


def group_ray_resources(group) -> dict[str, float]:
    """The custom resources one pod of `group` (a WorkerGroup) advertises to Ray."""
    text = group.rayStartParams.get("resources")
    out = {} if text is None else parse_ray_resources(text, "rayStartParams.resources")
    if group.role != "any":
        out[role_resource(group.role)] = float(ROLE_RESOURCE_UNITS)
    return out


def check_roles(values) -> None:
    """Cross-field rules of role groups (`values`: a ChartValues); ValueError with one line.

    Step 1: role resources come only from `role` (not written into rayStartParams by hand).
    Step 2: role groups need disaggregation (otherwise one autoscaled ModelServer runs anywhere).
    Step 3: with role groups, every pool has groups of its role, asks for its role's resource
    and not the other's, and its groups hold replicas x layout world GPUs (at maxReplicas when
    KubeRay's autoscaler may add pods, else at replicas). Without role groups a pool asking for
    a role resource could never be placed.
    """
    groups = values.workerGroups
    for i, g in enumerate(groups):
        text = g.rayStartParams.get("resources")
        if text is None:
            continue
        found = parse_ray_resources(text, f"workerGroups[{i}].rayStartParams.resources")
        for role in ROLES:
            if role_resource(role) in found:
                raise ValueError(
                    f"workerGroups[{i}].rayStartParams.resources names {role_resource(role)}: "
                    f"set workerGroups[{i}].role: {role} instead"
                )
    dis = values.serve.disaggregation
    if not dis.enabled:
        for i, g in enumerate(groups):
            if g.role != "any":
                raise ValueError(
                    f"workerGroups[{i}].role={g.role} needs serve.disaggregation.enabled "
                    "(without it one autoscaled ModelServer runs on any group)"
                )
        return
    by_role = {role: [(i, g) for i, g in enumerate(groups) if g.role == role] for role in ROLES}
    has_roles = any(by_role.values())
    at_max = values.autoscaling.enabled
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        pool, key, field = getattr(dis, role), role_resource(role), f"serve.disaggregation.{role}"
        if role_resource(other) in pool.resources:
            raise ValueError(
                f"{field}.resources asks {role_resource(other)}: {role} replicas would land on "
                f"the {other} groups"
            )
        if not has_roles:
            if key in pool.resources:
                raise ValueError(
                    f"{field}.resources asks {key} but no worker group has role {role}: its "
                    "replicas could never be placed"
                )
            continue
        if not by_role[role]:
            raise ValueError(
                f"workerGroups: no group has role {role}; with role groups each pool "
                "(prefill and decode) needs its own"
            )
        if pool.resources.get(key, 0) <= 0:
            raise ValueError(
                f"{field}.resources must ask {key} (e.g. {{{key}: 1}}) so its replicas land on "
                f"the role {role} groups; `moectl deploy render` writes it"
            )
        dims = pool.dims(values.serve.plan.dims())
        if dims is None:
            raise ValueError(
                f"{field}.layout is needed to size the role {role} groups "
                "(serve.plan gives no degrees)"
            )
        have = 0
        for i, g in by_role[role]:
            if g.gpusPerPod == 0:
                raise ValueError(
                    f"workerGroups[{i}].gpusPerPod=0: a {role} group runs layout "
                    f"{dims.shorthand} ({dims.world} GPUs a replica)"
                )
            top = g.replicas if g.maxReplicas is None else g.maxReplicas
            have += (top if at_max else g.replicas) * g.gpusPerPod
        need = pool.replicas * dims.world
        if have < need:
            names = [g.name for _, g in by_role[role]]
            counted = "maxReplicas" if at_max else "replicas"
            raise ValueError(
                f"workerGroups {names} (role {role}) hold {have} GPUs ({counted} x gpusPerPod); "
                f"{field} needs replicas={pool.replicas} x {dims.world} ({dims.shorthand}) = {need}"
            )


def pool_shapes(dims, replicas: int, node_gpus: int, plan=None) -> list[tuple[int, int]]:
    """[(GPUs per pod, pods)] of one pool: `replicas` copies of layout `dims`.

    A pool running the plan's own degrees keeps the plan's pods per node (one pod per node a
    replica uses); another layout takes one pod of `world` GPUs per replica when it fits a node
    of `node_gpus`, else `world / node_gpus` whole-node pods per replica.
    """
    if plan is not None and dims == plan.dims:
        per_node = Counter(Counter(r.node for r in plan.ranks).values())
        return sorted(((gpus, n * replicas) for gpus, n in per_node.items()), reverse=True)
    world = dims.world
    if world <= node_gpus:
        return [(world, replicas)]
    if world % node_gpus:
        raise InputError(
            f"layout {dims.shorthand} ({world} GPUs a replica) does not split into whole nodes "
            f"of {node_gpus} GPUs: give --gpus-per-node or another layout"
        )
    return [(node_gpus, replicas * (world // node_gpus))]


def size_role_groups(
    values: dict[str, Any], *, plan=None, node_gpus: int | None = None
) -> dict[str, Any]:
    """`values` (a mapping with serve.disaggregation.enabled) with one worker group per role
    (and pod shape) sized from that pool's layout and replicas, and each pool asking its role.

    Step 1: the template of a role is its first group in `values` (so its node selector,
    tolerations and sizes carry over), else the first group; `any` groups are dropped, so the
    GPUs requested are exactly the pools' (replicas x world each).
    Step 2: pods per shape from `pool_shapes`; min = max = replicas (the pools have fixed sizes).
    Step 3: `serve.disaggregation.<role>.resources` asks POOL_RESOURCE_ASK of the role resource.
    `node_gpus` (GPUs of one node) defaults to the largest gpusPerPod of the groups in `values`
    (or of the plan's nodes, if larger), so sizing its own output again changes nothing.
    """
    from deploy.config import parse_serve_config

    out = copy.deepcopy(values)
    cfg = parse_serve_config(out.get("serve"), origin="values: serve")
    groups = out.get("workerGroups") or []
    base = dict(groups[0]) if groups else {"name": "gpu", "gpusPerPod": 8}
    if node_gpus is None:
        node_gpus = max((int(g.get("gpusPerPod") or 0) for g in groups), default=8)
        if plan is not None:
            node_gpus = max([node_gpus, *Counter(r.node for r in plan.ranks).values()])
    if node_gpus < 1:
        raise InputError(f"gpus per node={node_gpus}: give --gpus-per-node N (N >= 1)")
    new_groups = []
    for role in ROLES:
        mine = next((g for g in groups if g.get("role") == role), None)
        if mine is not None:
            name = re.sub(r"-[0-9]+gpu$", "", mine["name"])
        else:
            name = f"{re.sub(r'-(prefill|decode)$', '', base['name'])}-{role}"
        template = dict(mine if mine is not None else base)
        pool = getattr(cfg.disaggregation, role)
        dims = pool.dims(cfg.plan.dims())
        if dims is None:
            raise InputError(
                f"values: serve.disaggregation.{role}.layout is needed to size its worker "
                "groups (serve.plan gives no degrees; or give --plan)"
            )
        try:
            shapes = pool_shapes(dims, pool.replicas, node_gpus, plan)
        except InputError as exc:
            raise InputError(f"values: serve.disaggregation.{role}: {exc}") from None
        for gpus, pods in shapes:
            group = dict(template)
            group.update(
                name=name if len(shapes) == 1 else f"{name}-{gpus}gpu",
                role=role,
                replicas=pods,
                minReplicas=pods,
                maxReplicas=pods,
                gpusPerPod=gpus,
            )
            new_groups.append(group)
        section = out["serve"]["disaggregation"].setdefault(role, {}) or {}
        asks = {k: v for k, v in (section.get("resources") or {}).items() if k not in _role_keys()}
        asks[role_resource(role)] = POOL_RESOURCE_ASK
        section["resources"] = asks
        out["serve"]["disaggregation"][role] = section
    out["workerGroups"] = new_groups
    return out


def pool_gpus(cfg) -> int:
    """GPUs of both pools of a disaggregated ServeConfig: sum of replicas x layout world."""
    total = 0
    for role in ROLES:
        pool = getattr(cfg.disaggregation, role)
        dims = pool.dims(cfg.plan.dims())
        total += pool.replicas * (1 if dims is None else dims.world)
    return total


def _role_keys() -> set[str]:
    return {role_resource(r) for r in ROLES}
