"""Which device the served engine runs on (`engine.device: auto | cuda | cpu`), chosen once by
`moectl serve` against the Ray cluster it joined, before any replica or worker actor starts.

- `cpu`: the engine and every rank on CPUs.
- `cuda`: one GPU per rank: the in-process engine's replica actor asks Ray for one, a multi-rank
  replica's ShardWorker actors ask for one each (their placement-group bundles carry it) and use
  the device Ray gives them. The cluster must have a GPU for every rank of one replica, else a
  one-line error naming the nodes and what they have (exit 3).
- `auto`: `cuda` where the cluster has a GPU for every rank of one replica, `cpu` otherwise.

A Serve config rendered for `serve deploy` or the Helm chart carries the device as written: there
no cluster is at hand to resolve `auto`, which requests no GPU (write `cuda` to ask for them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.errors import EnvironmentMissing

DEVICES = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class NodeResources:
    """One live Ray node as far as placing an engine goes."""

    name: str
    """Its address (or node id when Ray reports none)."""
    cpus: float
    gpus: float


def nodes_of(ray_nodes: Iterable[dict[str, Any]]) -> list[NodeResources]:
    """The live nodes of `ray.nodes()` (entries with "Alive", "NodeManagerAddress", "NodeID",
    "Resources")."""
    out = []
    for node in ray_nodes:
        if not node.get("Alive", False):
            continue
        resources = node.get("Resources") or {}
        out.append(
            NodeResources(
                name=str(node.get("NodeManagerAddress") or node.get("NodeID", "?")),
                cpus=float(resources.get("CPU", 0.0)),
                gpus=float(resources.get("GPU", 0.0)),
            )
        )
    return out


def resolve_device(
    requested: str, nodes: Sequence[NodeResources], *, ranks: int, layout: str
) -> str:
    """`cuda` or `cpu` for `requested` (one of DEVICES) on a cluster of `nodes`, where one
    replica runs `ranks` ranks of `layout`; EnvironmentMissing when `cuda` cannot be had."""
    if requested not in DEVICES:
        raise ValueError(f"engine.device={requested!r}; expected one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    gpus = sum(n.gpus for n in nodes)
    if requested == "auto":
        return "cuda" if gpus >= ranks > 0 else "cpu"
    if gpus == 0:
        have = "; ".join(f"{n.name} has {n.cpus:g} CPUs and no GPU" for n in nodes) or "no node"
        raise EnvironmentMissing(f"engine.device: cuda, but no Ray node has a GPU ({have})")
    if gpus < ranks:
        have = ", ".join(f"{n.name}: {n.gpus:g}" for n in nodes if n.gpus)
        raise EnvironmentMissing(
            f"engine.device: cuda: layout {layout} needs {ranks} GPUs (one per rank), the Ray "
            f"cluster has {gpus:g} ({have})"
        )
    return "cuda"
