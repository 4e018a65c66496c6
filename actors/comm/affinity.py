"""CPU affinity of the ranks of one host whose pipeline stages run in lock-step.

With more ranks on a host than cores, the stages of a CPU replica run one after the other (a
later stage waits for its predecessor's hand-off: actors/comm/pp.py), so the ranks that compute
at once are the members of one stage. Pinning the i-th rank of each stage on this host to core
i mod cores (ep2xpp2 on 2 cores: ranks 0 and 2 on the first core, 1 and 3 on the second) gives
each core one computing rank at a time, and the two EP peers of a stage always run side by side
instead of queueing behind each other on one core.

Pinned so, with a core for every rank of the stage, the stage's exchanges spin
(`SPIN_S`) before they block, as on a host with a core per rank: the peer they
wait for is running on the other core, not queued behind them.

`MOE_PIN_RANKS`: "1" pins, "0" never, "auto" (the default) pins when this host has more ranks
than usable cores. The other processes of the host (a Serve replica, its proxy) stay free to
run on any core. Served ep2xpp2 at concurrency 4 on a 2-core host:
144-179 output tokens/s pinned against 82-175 unpinned over 6 interleaved pairs, the unpinned
runs collapsing to 82-99 in 2 of them under a neighbour's load; ep2 (2 ranks, 2 cores) pinned:
no change, so "auto" leaves it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

MODES = ("0", "1", "auto")
_CORES: list[int] = []
"""The cores this process could use before it pinned itself (a rebuilt rank re-pins from these)."""

SPIN_S = float(os.environ.get("MOE_LOCAL_SPIN_US", "300")) * 1e-6
"""How long a member polls its sockets without sleeping (yielding the core between tries) before
it blocks in `poll`: a peer that answers within it costs no wake-up. On this 2-core box an ep2
decode step took 4.2 / 3.4 / 3.3 ms with 0 / 100 / 300 us, and served batch-1 output 112 / 136 /
148 tokens/s (MOE_LOCAL_SPIN_US sets it). Only when this host has a core per rank of the world
(`spin_for`): with four ranks on two cores, spinning ranks took the cores their peers needed
(ep2xpp2 served batch 1: 78 tokens/s without, 56 with)."""


def mode() -> str:
    value = os.environ.get("MOE_PIN_RANKS", "auto")
    return value if value in MODES else "auto"


def usable_cores() -> list[int]:
    """The cores this process may run on, ascending (as before any `pin_process`)."""
    if not _CORES:
        if hasattr(os, "sched_getaffinity"):
            _CORES.extend(sorted(os.sched_getaffinity(0)))
        else:
            _CORES.extend(range(os.cpu_count() or 1))
    return list(_CORES)


def stage_peers(rank: int, stage_of: Sequence[int], hosts: Sequence[str]) -> list[int]:
    """The ranks of `rank`'s pipeline stage on its host (`stage_of[r]`: the stage of rank r;
    `hosts[r]`: its host id), in rank order."""
    return [
        r for r in range(len(stage_of)) if stage_of[r] == stage_of[rank] and hosts[r] == hosts[rank]
    ]


def core_for(rank: int, stage_of: Sequence[int], hosts: Sequence[str], cores: Sequence[int]) -> int:
    """The core of `rank`: its index among the ranks of its stage on its host, mod the cores;
    where the host has a core per rank (stages that may overlap), its index on the host."""
    on_host = [r for r in range(len(hosts)) if hosts[r] == hosts[rank]]
    if len(on_host) <= len(cores):
        return cores[on_host.index(rank)]
    return cores[stage_peers(rank, stage_of, hosts).index(rank) % len(cores)]


def stage_has_cores(rank: int, stage_of: Sequence[int], hosts: Sequence[str]) -> bool:
    """Whether every rank of `rank`'s stage on its host got a core of its own when pinned (the
    ranks that compute at once each have one, so their exchanges may spin)."""
    return len(stage_peers(rank, stage_of, hosts)) <= len(usable_cores())


def wanted(ranks_on_host: int, cores: Sequence[int]) -> bool:
    """Whether to pin under the current `MOE_PIN_RANKS` mode."""
    m = mode()
    if m == "auto":
        return ranks_on_host > len(cores)
    return m == "1" and ranks_on_host > 1


def pin_process(cores: Sequence[int]) -> None:
    """Every thread of this process (and the threads they start later) onto `cores`."""
    usable_cores()  # remember the cores from before
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), set(cores))


def pin_rank(
    rank: int, stage_of: Sequence[int], hosts: Sequence[str], spin: Sequence = ()
) -> int | None:
    """Pin this process for `rank` when `wanted`; returns the core, or None (not pinned: a
    process pinned by an earlier build gets all its usable cores back). Pinned, with a core
    for every rank of its stage on the host, the local transports in `spin` get
    `SPIN_S` (their peers of the running stage each have a core)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = usable_cores()
    if not hosts or not wanted(hosts.count(hosts[rank]), cores):
        if set(os.sched_getaffinity(0)) != set(cores):
            pin_process(cores)
        return None
    core = core_for(rank, stage_of, hosts, cores)
    pin_process([core])
    if stage_has_cores(rank, stage_of, hosts):
        for transport in spin:
            transport.spin_s = SPIN_S
    return core
