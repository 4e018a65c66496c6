"""CPU affinity of lock-step ranks (actors/comm/affinity.py): which core, when, and that the
whole process (threads started before and after) ends up there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actors.comm import affinity
from actors.comm.group import Rendezvous
from actors.comm.local_transport import SPIN_S, spin_for
from actors.executor.rank_runner import run_ranks
from placement.parallel_dims import Layout, parse_layout
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity on this platform"
)


def test_each_stage_spreads_over_the_cores():
    one_host = ["h"] * 4
    ep2xpp2 = [0, 0, 1, 1]  # stage of ranks 0..3
    assert [affinity.core_for(r, ep2xpp2, one_host, [0, 1]) for r in range(4)] == [0, 1, 0, 1]
    assert [affinity.core_for(r, ep2xpp2, one_host, [3, 5]) for r in range(4)] == [3, 5, 3, 5]
    assert [affinity.core_for(r, ep2xpp2, one_host, [7]) for r in range(4)] == [7, 7, 7, 7]
    # ranks of another host do not count: two stages, one per host, two ranks each
    two_hosts = ["a", "a", "b", "b"]
    assert [affinity.core_for(r, [0, 0, 1, 1], two_hosts, [0, 1]) for r in range(4)] == [0, 1] * 2
    # pp4 on one host: every rank is the first of its stage
    assert [affinity.core_for(r, [0, 1, 2, 3], one_host, [0, 1]) for r in range(4)] == [0] * 4
    # a core per rank on the host (stages may overlap): one core each
    assert [affinity.core_for(r, [0, 1], ["h"] * 2, [0, 1]) for r in range(2)] == [0, 1]
    four = [affinity.core_for(r, ep2xpp2, one_host, [0, 1, 2, 3]) for r in range(4)]
    assert four == list(range(4))


def test_modes(monkeypatch):
    monkeypatch.delenv("MOE_PIN_RANKS", raising=False)
    assert affinity.mode() == "auto"
    assert affinity.wanted(4, [0, 1]) and not affinity.wanted(2, [0, 1])
    monkeypatch.setenv("MOE_PIN_RANKS", "1")
    assert affinity.wanted(2, [0, 1]) and not affinity.wanted(1, [0, 1])
    monkeypatch.setenv("MOE_PIN_RANKS", "0")
    assert not affinity.wanted(4, [0, 1])
    monkeypatch.setenv("MOE_PIN_RANKS", "bogus")
    assert affinity.mode() == "auto"


PIN_SCRIPT = """
import json, os, threading
from actors.comm import affinity
from actors.comm.local_transport import SPIN_S, core_per_rank, spin_for
every = sorted(os.sched_getaffinity(0))
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
core = affinity.pin_rank(3, [0, 0, 1, 1], ["h"] * 4)
seen = {}
after = threading.Thread(target=lambda: seen.update(after=sorted(os.sched_getaffinity(0))))
after.start(); after.join()
threads = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
overlap = core_per_rank(len(every))
unpinned = affinity.pin_rank(0, [0], ["h"])
stop.set(); before.join()
print(json.dumps({"every": every, "core": core, "threads": threads, "after": seen["after"],
                  "overlap": overlap, "unpinned": unpinned,
                  "back": sorted(os.sched_getaffinity(0))}))
"""


def test_pin_rank_moves_every_thread_and_a_later_build_unpins():
    """In a fresh process: rank 3 of ep2xpp2 (MOE_PIN_RANKS=1) goes to the second usable core
    (mod their count; the fourth where there are four) with every thread, one started before and one after; the cores counted
    for overlap stay the ones from before; a later build that does not pin gets them back."""
    env = {**os.environ, "MOE_PIN_RANKS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PIN_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    every = got["every"]
    want = every[3] if len(every) >= 4 else every[1 % len(every)]  # a core per rank, or by stage
    assert got["core"] == want
    assert len(got["threads"]) >= 2
    assert all(cores == [want] for cores in got["threads"].values())
    assert got["after"] == [want]
    assert got["overlap"] is True  # core_per_rank(len(every)) counted the cores from before
    assert got["unpinned"] is None and got["back"] == every


def _pinned_core(rank, world_size, rendezvous, layout, path):
    from actors.executor.worker import ShardWorker

    worker = ShardWorker(layout=layout, rank=rank, checkpoint_dir=path, rendezvous=rendezvous)
    try:
        from placement.parallel_dims import Axis

        return {
            "core": worker.health()["core"],
            "cores": sorted(os.sched_getaffinity(0)),
            "spin_s": worker.groups[Axis.EP].local.spin_s,
        }
    finally:
        worker.close()


@pytest.mark.parametrize("pin", ["1", "0"])
def test_shard_workers_of_ep2xpp2_pin_per_stage(tmp_path, monkeypatch, pin):
    """Four ShardWorker processes of one host: with MOE_PIN_RANKS=1 the EP peers of each stage
    sit on different cores (when there are two) and the stages share them, and their EP
    exchanges spin; with 0 nothing is pinned and the spin is the host's (none for 4 ranks on
    fewer cores)."""
    monkeypatch.setenv("MOE_PIN_RANKS", pin)
    path = make_tiny_checkpoint("mixtral", tmp_path)
    layout = Layout.build(parse_layout("ep2xpp2"), num_layers=4, num_experts=4)
    got = run_ranks(
        _pinned_core, 4, args=(layout, str(path)), rendezvous=Rendezvous.fresh(), timeout_s=120
    )
    every = sorted(os.sched_getaffinity(0))
    if pin == "0":
        assert [g["core"] for g in got] == [None] * 4
        assert all(g["cores"] == every for g in got)
        assert [g["spin_s"] for g in got] == [spin_for(4)] * 4
        return
    want = every[:4] if len(every) >= 4 else [every[i % len(every)] for i in (0, 1, 0, 1)]
    assert [g["core"] for g in got] == want
    assert [g["cores"] for g in got] == [[c] for c in want]
    # an EP stage of two: its ranks spin before they block when each has a core
    assert [g["spin_s"] for g in got] == [SPIN_S if len(every) >= 2 else spin_for(4)] * 4
