"""Write-down off the step thread (actors/engine/block_writer.py): a finished request's blocks go
to the tiers from the writer thread, so its last output is returned before the tier has them; the
blocks are held (not reusable) until written, then marked stored and released; a write-down past
the bound is cut to the leading blocks that fit (the rest counted); the tokens a later engine
reads back from the tier equal a cold run's."""

from __future__ import annotations

import threading

import pytest

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt

SECRET = b"write-down-secret"
KW = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4,
      "batch_invariant": False}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("write-down"))


class GatedCache:
    """A host tier whose puts wait for `gate` (a tier that is slow to write)."""

    def __init__(self, inner) -> None:
        self.inner, self.gate, self.puts = inner, threading.Event(), 0

    def get(self, key):
        return self.inner.get(key)

    def put(self, key, block) -> bool:
        self.gate.wait(30)
        self.puts += 1
        return self.inner.put(key, block)

    def longest_prefix(self, keys) -> int:
        return self.inner.longest_prefix(keys)


@pytest.fixture
def tier(ckpt, request):
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    ns = CacheNamespace(
        model_fingerprint=weights_fingerprint(ckpt), deployment=request.node.name[:40]
    )
    with TieredCache.from_urls(["host://"], capacities=[1 << 24], namespace=ns) as c:
        yield GatedCache(c)


def _run(engine, rid, ids, n=5):
    engine.add_request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def test_the_last_output_comes_before_the_write_and_the_blocks_wait_for_it(ckpt, tier):
    engine = build_engine(ckpt, cache=tier, cache_key_secret=SECRET, **KW)
    assert engine.writer is not None
    ids = prompt(30, 1)
    got = _run(engine, "a", ids)  # every output returned while the tier's puts are blocked
    assert len(got) == 5 and tier.puts == 0
    held = engine.writer.pending
    assert held == (30 + 5 - 1) // 4  # the computed full blocks, handed over
    assert engine.blocks.free_count == KW["num_blocks"] - held  # not reusable meanwhile
    assert engine.stats()["tier_writes_pending"] == held
    tier.gate.set()
    assert engine.flush_writes(30)
    assert tier.puts == held and engine.blocks.free_count == KW["num_blocks"]
    # A fresh engine (empty device pool) reads them back: the same tokens as a cold run.
    again = build_engine(ckpt, cache=tier, cache_key_secret=SECRET, **KW)
    assert _run(again, "b", ids) == got
    assert again.stats()["tier_hits"] == (30 - 1) // 4
    cold = build_engine(ckpt, cache_key_secret=SECRET, **KW)
    assert _run(cold, "c", ids) == got


def test_a_write_down_past_the_bound_keeps_its_leading_blocks(ckpt, tier):
    engine = build_engine(ckpt, cache=tier, cache_key_secret=SECRET, **KW)
    engine.writer.max_pending = 3
    _run(engine, "a", prompt(30, 2))
    assert engine.writer.pending == 3 and engine.stats()["tier_writes_dropped"] == 8 - 3
    tier.gate.set()
    assert engine.flush_writes(30)
    assert tier.puts == 3 and engine.blocks.free_count == KW["num_blocks"]
    again = build_engine(ckpt, cache=tier, cache_key_secret=SECRET, **KW)
    _run(again, "b", prompt(30, 2))
    assert again.stats()["tier_hits"] == 3  # the leading three; the rest recomputed
