"""Prefill and decode roles (prefill/decode disaggregation) on the in-process engine.

A prefill engine runs the prompt, samples the first token and hands the request over with its
full prompt blocks in the tiers; a decode engine resumes it from those blocks. The tokens must
equal a mixed engine's (greedy and seeded sampling), and the decode engine must really read the
handed-over blocks (not recompute them): corrupting them in the tier changes what it loads (a
miss, then recompute), never the tokens.
"""

from __future__ import annotations

import pytest

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from cluster.errors import InputError
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt, run, tokens
from tests.actors.tiny_tokenizer import install

SECRET = b"roles-secret"
KW = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("roles"))
    install(path)
    return path


@pytest.fixture
def cache(ckpt, request):
    from cache_service.block_key import weights_fingerprint
    from cache_service.namespace import CacheNamespace
    from cache_service.store import TieredCache

    ns = CacheNamespace(model_fingerprint=weights_fingerprint(ckpt), deployment=request.node.name)
    with TieredCache.from_urls(["host://"], capacities=[1 << 24], namespace=ns) as c:
        yield c


def engine(ckpt, cache=None, role="mixed"):
    return build_engine(ckpt, cache=cache, cache_key_secret=SECRET, role=role, **KW)


def hand_over(ckpt, cache, requests):
    """Prefill every request, then resume each handoff on a fresh decode engine; returns the
    tokens per request (first token from prefill, the rest from decode), the handoffs and the
    decode engine."""
    pre = engine(ckpt, cache, "prefill")
    first = run(pre, requests)
    dec = engine(ckpt, cache, "decode")
    handoffs = {}
    for rid, outs in first.items():
        last = outs[-1]
        if last.finish_reason == "handoff":
            h = last.handoff
            handoffs[rid] = h
            dec.resume_request(rid, list(h.prompt_token_ids), requests[rid][1], **h.resume_kwargs())
    rest = {rid: [] for rid in requests}
    while dec.has_unfinished():
        for o in dec.step():
            rest[o.request_id].append(o)
    out = {rid: tokens(first[rid]) + tokens(rest[rid]) for rid in requests}
    return out, handoffs, dec, first, rest


def test_disaggregated_tokens_equal_mixed(ckpt, cache):
    requests = {
        "greedy": (prompt(23, 1), SamplingParams(max_tokens=8, ignore_eos=True)),
        "seeded": (prompt(30, 2), SamplingParams(max_tokens=7, temperature=0.9, seed=5)),
        "short": (prompt(3, 3), SamplingParams(max_tokens=5, ignore_eos=True)),
    }
    mixed = {rid: tokens(o) for rid, o in run(engine(ckpt), requests).items()}
    out, handoffs, dec, first, rest = hand_over(ckpt, cache, requests)
    assert out == mixed
    # The prefill side produced exactly one token per request and ended it with a handoff.
    for rid, outs in first.items():
        assert tokens(outs) == mixed[rid][:1]
        assert outs[-1].finished and outs[-1].finish_reason == "handoff"
    # Full prompt blocks went to the tiers; the decode engine read them instead of recomputing.
    h = handoffs["greedy"]
    assert (h.blocks, h.blocks_stored) == (23 // 4, 23 // 4)
    assert h.bytes_written > 0 and h.output_token_ids == tuple(mixed["greedy"][:1])
    loadable = sum((len(requests[r][0]) + 1 - 1) // 4 for r in requests)
    assert dec.stats()["tier_hits"] == loadable
    # Decode's outputs carry on the counts: completion tokens include the prefill's token.
    assert rest["greedy"][-1].completion_tokens == 8
    assert rest["greedy"][-1].finish_reason == "length"


def test_text_is_streamed_once(ckpt, cache):
    """The client sees the first token's text from prefill and the rest from decode: together
    exactly the mixed engine's text."""
    requests = {"t": (prompt(17, 4), SamplingParams(max_tokens=9, ignore_eos=True))}
    mixed = "".join(o.text_delta for o in run(engine(ckpt), requests)["t"])
    _, _, _, first, rest = hand_over(ckpt, cache, requests)
    assert "".join(o.text_delta for o in first["t"] + rest["t"]) == mixed


def test_a_request_that_ends_at_its_first_token_is_not_handed_over(ckpt, cache):
    requests = {"one": (prompt(12, 6), SamplingParams(max_tokens=1, ignore_eos=True))}
    outs = run(engine(ckpt, cache, "prefill"), requests)["one"]
    assert outs[-1].finish_reason == "length" and outs[-1].handoff is None


def test_corrupt_handed_over_blocks_are_recomputed(ckpt, cache):
    """A block damaged in the tier after the handoff (a half-written value) is a miss: the
    decode engine loads only the intact blocks before it and recomputes from there."""
    requests = {"c": (prompt(26, 7), SamplingParams(max_tokens=6, ignore_eos=True))}
    mixed = tokens(run(engine(ckpt), requests)["c"])
    pre = engine(ckpt, cache, "prefill")
    h = run(pre, requests)["c"][-1].handoff
    seq_keys = []
    pre.keyer.extend(seq_keys, list(h.prompt_token_ids), h.blocks)
    top = cache.tiers[0]
    (raw,) = top.get_many([seq_keys[2]])
    assert raw is not None
    assert top.delete([seq_keys[2]]) == 1  # then the same key holding half its bytes
    assert top.put_many([(seq_keys[2], raw[: len(raw) // 2])]).stored == [True]
    dec = engine(ckpt, cache, "decode")
    dec.resume_request("c", list(h.prompt_token_ids), requests["c"][1], **h.resume_kwargs())
    rest = []
    while dec.has_unfinished():
        rest += dec.step()
    assert list(h.output_token_ids) + tokens(rest) == mixed
    assert dec.stats()["tier_hits"] == 2


def test_prefill_role_needs_a_cache_and_roles_are_checked(ckpt):
    with pytest.raises(InputError, match="needs a cache"):
        engine(ckpt, None, "prefill")
    with pytest.raises(InputError, match="expected one of mixed, prefill, decode"):
        engine(ckpt, None, "both")


def test_a_failing_tier_costs_the_handoff_its_blocks_not_its_tokens(ckpt):
    """The shared tier unavailable: puts fail (counted), the handoff says 0 blocks stored, and
    the decode engine recomputes the whole prompt with the same tokens."""

    class Down:
        def get(self, key):
            raise ConnectionError("tier down")

        def put(self, key, block):
            raise ConnectionError("tier down")

        def longest_prefix(self, keys):
            raise ConnectionError("tier down")

    requests = {"d": (prompt(21, 8), SamplingParams(max_tokens=6, ignore_eos=True))}
    mixed = tokens(run(engine(ckpt), requests)["d"])
    out, handoffs, dec, _, _ = hand_over(ckpt, Down(), requests)
    assert out["d"] == mixed
    assert handoffs["d"].blocks == 5 and handoffs["d"].blocks_stored == 0
    assert handoffs["d"].bytes_written == 0
    assert dec.stats()["tier_hits"] == 0 and dec.stats()["cache"]["faults"] >= 1


class ThreadLog:
    """A cache that records which thread each read came from (forwarding to a real cache)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def _note(self):
        import threading

        self.reads.append(threading.current_thread().name)

    def get(self, key):
        self._note()
        return self.inner.get(key)

    def get_many(self, keys):
        self._note()
        return self.inner.get_many(keys)

    def longest_prefix(self, keys):
        self._note()
        return self.inner.longest_prefix(keys)

    def put(self, key, block):
        return self.inner.put(key, block)

    def put_many(self, items):
        return self.inner.put_many(items)

    def stats(self):
        return self.inner.stats()


def test_async_decode_reads_handed_over_blocks_off_the_step_thread(ckpt, cache):
    """Through AsyncEngine a resumed request's blocks are read on a prefetch worker while the
    engine keeps stepping; the tokens are the mixed engine's, and the blocks were used."""
    import asyncio

    from actors.engine.async_engine import AsyncEngine

    params = SamplingParams(max_tokens=7, ignore_eos=True)
    ids = prompt(29, 9)
    mixed = tokens(run(engine(ckpt), {"a": (ids, params)})["a"])
    h = run(engine(ckpt, cache, "prefill"), {"a": (ids, params)})["a"][-1].handoff
    log = ThreadLog(cache)
    dec = engine(ckpt, log, "decode")
    aeng = AsyncEngine(dec)

    async def go():
        resume = h.resume_kwargs()
        return [
            o async for o in aeng.generate("a", list(h.prompt_token_ids), params, resume=resume)
        ]

    try:
        outs = asyncio.run(go())
    finally:
        aeng.shutdown()
    assert list(h.output_token_ids) + tokens(outs) == mixed
    assert dec.stats()["tier_hits"] == 29 // 4
    # Reads came from the prefetch worker (and load_many's own fetch threads), never the
    # thread that steps the engine.
    assert any(name.startswith("kv-prefetch") for name in log.reads), log.reads
    assert "engine-step" not in log.reads, log.reads


def test_a_resume_aborted_while_prefetching_is_never_admitted(ckpt, cache):
    import time

    from actors.engine.async_engine import AsyncEngine

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    h = run(engine(ckpt, cache, "prefill"), {"b": (prompt(21, 10), params)})["b"][-1].handoff
    dec = engine(ckpt, cache, "decode")
    aeng = AsyncEngine(dec)
    try:
        aeng._send(("resume", "b", list(h.prompt_token_ids), params, h.resume_kwargs()))
        aeng.abort("b")
        deadline = time.monotonic() + 10
        while aeng._prefetching and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert "b" not in dec.seqs and not dec.has_unfinished()
    finally:
        aeng.shutdown()
