"""The Ray shell of `cluster`: discovery of every node and the probe across Ray actors.

Imported lazily (only commands that touch a Ray cluster load it). The work itself lives in plain
modules: `cluster.discovery.node_facts` runs in one task per node, `cluster.probe.sweep` in one
actor per rank.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.discovery import assemble, node_facts, template_from_facts
from cluster.errors import CheckFailed, EnvironmentMissing
from cluster.nccl_tests import NcclRun
from cluster.probe import SweepConfig, run_from_json, sweep
from cluster.topology import Topology

NODE_LABEL = "moe.io/node"


@dataclass(frozen=True, kw_only=True)
class Target:
    """A node to ask: its display name, Ray node id and address."""

    name: str
    node_id: str
    address: str | None


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ('auto' for the local one) unless already connected."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "auto", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise EnvironmentMissing(f"no Ray cluster at {address or 'auto'}: {exc}") from None


def alive_targets() -> list[Target]:
    """Every alive node, named by its `moe.io/node` label, else its hostname (made unique)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    targets = []
    seen: set[str] = set()
    for n in nodes:
        name = (n.get("Labels") or {}).get(NODE_LABEL) or n.get("NodeManagerHostname") or "node"
        if name in seen:
            name = f"{name}-{n['NodeID'][:8]}"
        seen.add(name)
        targets.append(Target(name=name, node_id=n["NodeID"], address=n.get("NodeManagerAddress")))
    return targets


@ray.remote(num_cpus=0, max_retries=0)
def _facts() -> dict:
    return node_facts()


def gather_facts(
    targets: list[Target],
    *,
    timeout_s: float,
    on_done: Callable[[Target], None] | None = None,
) -> tuple[dict[str, dict], list[str]]:
    """Run `node_facts` on each target (hard node affinity); (facts by name, unreachable names).

    A node whose task fails or has not answered after `timeout_s` is reported, never waited on.
    """
    refs = {
        _facts.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=t.node_id, soft=False)
        ).remote(): t
        for t in targets
    }
    facts: dict[str, dict] = {}
    unreachable: list[str] = []
    pending = list(refs)
    import time

    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(
            pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0)
        )
        if not ready:
            break
        target = refs[ready[0]]
        try:
            facts[target.name] = ray.get(ready[0])
        except ray.exceptions.RayError:
            unreachable.append(target.name)
        if on_done is not None:
            on_done(target)
    for ref in pending:
        ray.cancel(ref, force=True)
        unreachable.append(refs[ref].name)
    return facts, sorted(unreachable)


def discover_cluster(
    *,
    timeout_s: float = 30.0,
    targets: list[Target] | None = None,
    on_done: Callable[[Target], None] | None = None,
) -> tuple[Topology, list[str]]:
    """The connected Ray cluster as a Topology (answering nodes) and the unreachable names."""
    targets = alive_targets() if targets is None else targets
    facts, unreachable = gather_facts(targets, timeout_s=timeout_s, on_done=on_done)
    per_node = [
        (t.name, t.address, template_from_facts(facts[t.name], name=t.name))
        for t in targets
        if t.name in facts
    ]
    if not per_node:
        raise EnvironmentMissing(
            f"no node answered within {timeout_s:.0f} s: {', '.join(unreachable)}"
        )
    return assemble("ray-cluster", per_node), unreachable


@ray.remote(num_cpus=0.25, max_restarts=0)
class ProbeRank:
    """One rank of the probe; runs `cluster.probe.sweep` (the same body as probe_local)."""

    def endpoint(self) -> str:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            return f"tcp://{ip}:{sock.getsockname()[1]}"

    def run(self, rank: int, world: int, init: str, config: SweepConfig) -> list[dict] | None:
        return sweep(rank, world, init, config)


def probe_ray(world: int, config: SweepConfig) -> list[NcclRun]:
    """The probe over `world` Ray actors spread over the nodes (gloo on CPUs, NCCL on GPUs)."""
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= world else 0
    actors = [
        ProbeRank.options(num_gpus=gpus, scheduling_strategy="SPREAD").remote()
        for _ in range(world)
    ]
    try:
        init = ray.get(actors[0].endpoint.remote(), timeout=config.timeout_s)
        refs = [a.run.remote(r, world, init, config) for r, a in enumerate(actors)]
        budget = config.timeout_s * (2 + len(config.ops) * len(config.sizes))
        try:
            results = ray.get(refs, timeout=budget)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
            raise CheckFailed(
                f"probe over {world} Ray actors failed: {type(exc).__name__}"
            ) from None
    finally:
        for a in actors:
            ray.kill(a)
    return [run_from_json(r) for r in results[0]]
