"""The runner protocol (`actors.executor.protocol.Runner`) is every call the engine makes: both
runners implement all of it, and an engine whose runner exposes nothing else still serves
prefix tails (`copy_block`), tier hits (`available_kv`, `load_kv`), write-downs (`store_kv`) and
its stats (`timing_stats`)."""

from __future__ import annotations

import pytest

from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.executor.protocol import Runner
from actors.executor.replica import Replica
from actors.executor.runner import LocalRunner
from cache_service.block_key import weights_fingerprint
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
MEMBERS = {n for n in dir(Runner) if not n.startswith("_")} | set(Runner.__annotations__)


class OnlyProtocol:
    """A runner that answers only the protocol's members (an AttributeError for the rest)."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "asked", set())

    def __getattr__(self, name: str):
        if name not in MEMBERS:
            raise AttributeError(f"the engine asked the runner for {name!r}, not in the protocol")
        self.asked.add(name)
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("proto"), num_hidden_layers=2)


def test_the_protocol_names_what_the_engine_needs():
    assert {"execute", "allocate_kv", "copy_block", "attach_tiers"} <= MEMBERS
    assert {"available_kv", "store_kv", "load_kv"} <= MEMBERS
    assert {"overlaps", "launch", "collect", "timing_stats", "device", "kv_layout"} <= MEMBERS


@pytest.mark.parametrize("cls", [LocalRunner, Replica])
def test_both_runners_implement_every_member(cls):
    """Methods and properties on the class (`device`, and LocalRunner's `arch`, are set by
    `__init__`: the instance test below covers them)."""
    missing = sorted(m for m in MEMBERS - {"device", "arch"} if not hasattr(cls, m))
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_the_in_process_runner_is_a_runner(ckpt):
    runner = LocalRunner.from_checkpoint(ckpt)
    runner.allocate_kv(8, 8)
    assert isinstance(runner, Runner) and runner.device.type == "cpu"


def test_an_engine_over_the_protocol_alone_serves_tails_and_tier_hits(ckpt, tmp_path):
    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpt), deployment="protocol-test")
    shared = prompt(21, 13)  # blocks of 8: two full, then 5 tokens of a third
    second = shared[:20] + prompt(3, 14)
    kw = dict(block_size=8, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    cold = tokens(run(build_engine(ckpt, **kw), {"s": (second, GREEDY)})["s"])
    with TieredCache.from_urls(["host://"], capacities=[1 << 24], namespace=ns) as cache:
        kw.update(cache=cache, cache_key_secret=b"k")
        first = build_engine(ckpt, **kw)
        run(first, {"first": (shared, GREEDY)})
        first.drain()
        runner = OnlyProtocol(LocalRunner.from_checkpoint(ckpt))
        engine = build_engine(ckpt, runner=runner, **kw)
        assert isinstance(engine, Engine)
        run(engine, {"first": (shared, GREEDY)})  # its blocks come back from the tier
        hot = run(engine, {"s": (second, GREEDY)})["s"]
        stats = engine.stats()
    assert stats["tier_hits"] > 0 and stats["prefix_tail_tokens"] >= 4
    assert tokens(hot) == cold
    assert {"load_kv", "available_kv", "store_kv", "copy_block", "timing_stats"} <= runner.asked
