"""Engine end to end on tiny checkpoints: greedy vs transformers, batch invariance, prefix
caching, preemption, abort, stop conditions, seeded sampling, AsyncEngine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.engine.async_engine import AsyncEngine
from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from cluster.errors import InputError
from tests.actors.checkpoints import load_reference, make_tiny_checkpoint
from tests.actors.tiny_tokenizer import install

SECRET = b"test-secret"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for family in ("mixtral", "deepseek_v3", "qwen3_moe"):
        path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family), num_hidden_layers=2)
        install(path)
        out[family] = path
    return out


def make_engine(path, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_num_seqs", 4)
    return build_engine(path, cache_key_secret=SECRET, **kw)


def run(engine, requests):
    """requests: {id: (prompt, params)}; returns {id: [RequestOutput, ...]}, once the finished
    requests' blocks are in the tiers too (written off the step thread: `flush_writes`)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {rid: [] for rid in requests}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
    flush = getattr(engine, "flush_writes", None)  # (a RecoveringEngine has none)
    assert flush is None or flush(30)
    return outs


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 96, (n,), generator=g).tolist()


def reference_greedy(model, ids, n):
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "qwen3_moe"])
def test_greedy_generation_matches_transformers(ckpts, family):
    ref = load_reference(ckpts[family])
    prompts = {"a": prompt(21, 1), "b": prompt(9, 2)}
    engine = make_engine(ckpts[family], max_num_batched_tokens=12)  # chunked prefill
    outs = run(engine, {k: (p, GREEDY) for k, p in prompts.items()})
    for rid, p in prompts.items():
        assert tokens(outs[rid]) == reference_greedy(ref, p, 8)
        last = outs[rid][-1]
        assert last.finished and last.finish_reason == "length" and last.completion_tokens == 8


def test_batched_equals_alone_bitwise(ckpts):
    """Tokens and logprobs of each request are identical alone and in a batch with others."""
    reqs = {
        "g": (prompt(30, 3), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)),
        "s": (
            prompt(7, 4),
            SamplingParams(
                max_tokens=6, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=2
            ),
        ),
        "k": (
            prompt(18, 5),
            SamplingParams(
                max_tokens=6, temperature=1.2, top_k=5, seed=6, ignore_eos=True, logprobs=2
            ),
        ),
    }
    alone = {rid: run(make_engine(ckpts["qwen3_moe"]), {rid: r})[rid] for rid, r in reqs.items()}
    together = run(make_engine(ckpts["qwen3_moe"]), reqs)
    for rid in reqs:
        assert tokens(together[rid]) == tokens(alone[rid])
        assert [o.logprobs for o in together[rid]] == [o.logprobs for o in alone[rid]]


def test_prefix_cache_hit_reports_cached_tokens_and_equals_cold(ckpts):
    shared = prompt(26, 7)
    second = shared + prompt(5, 8)
    engine = make_engine(ckpts["mixtral"])
    run(engine, {"first": (shared, GREEDY)})
    baseline = engine.stats()["free_blocks"]
    hot = run(engine, {"second": (second, GREEDY)})["second"]
    cold = run(make_engine(ckpts["mixtral"]), {"second": (second, GREEDY)})["second"]
    assert tokens(hot) == tokens(cold)
    assert hot[-1].cached_tokens == 24 and cold[-1].cached_tokens == 0  # 6 full blocks of 4
    stats = engine.stats()
    assert stats["prefix_hits"] >= 6 and stats["free_blocks"] == baseline == stats["total_blocks"]


def test_preemption_recomputes_and_returns_every_block(ckpts):
    reqs = {
        f"r{i}": (
            prompt(10, 20 + i),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 * (i % 2), seed=i),
        )
        for i in range(3)
    }
    alone = {
        rid: tokens(run(make_engine(ckpts["mixtral"]), {rid: r})[rid]) for rid, r in reqs.items()
    }
    engine = make_engine(ckpts["mixtral"], num_blocks=9, max_num_seqs=3)  # 6 blocks per request
    outs = run(engine, reqs)
    assert engine.stats()["preemptions"] > 0
    for rid in reqs:
        assert tokens(outs[rid]) == alone[rid]
    assert engine.stats()["free_blocks"] == 9


def test_abort_frees_blocks_and_reports_abort(ckpts):
    engine = make_engine(ckpts["mixtral"])
    baseline = engine.stats()["free_blocks"]
    engine.add_request("x", prompt(20, 9), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", prompt(20, 10), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats()["free_blocks"] < baseline
    engine.abort("x")
    engine.abort("y")
    outs = engine.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {("x", "abort"), ("y", "abort")}
    assert engine.stats()["free_blocks"] == baseline and not engine.has_unfinished()


def test_stop_strings_token_ids_eos_and_text(ckpts):
    engine = make_engine(ckpts["mixtral"])
    p = prompt(12, 11)
    full = run(engine, {"a": (p, SamplingParams(max_tokens=12, ignore_eos=True))})["a"]
    ids = tokens(full)
    text = "".join(o.text_delta for o in full)
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    # A stop string taken from the middle of that text.
    stop = text[5:7]
    cut = run(engine, {"b": (p, SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))})
    assert "".join(o.text_delta for o in cut["b"]) == text[: text.find(stop)]
    assert cut["b"][-1].finish_reason == "stop"
    # A stop token id: generation ends on it, the token is the last returned.
    by_id = run(
        engine, {"c": (p, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(ids[3],)))}
    )["c"]
    assert tokens(by_id) == ids[: ids.index(ids[3]) + 1] and by_id[-1].finish_reason == "stop"
    # EOS: with the checkpoint's eos_token_id set to a token greedy decoding emits.
    engine.eos_token_id = ids[2]
    eos = run(engine, {"d": (p, SamplingParams(max_tokens=12))})["d"]
    assert tokens(eos) == ids[: ids.index(ids[2]) + 1] and eos[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_seed_dependent(ckpts):
    p = prompt(9, 12)

    def sample(seed):
        params = SamplingParams(max_tokens=10, temperature=1.5, seed=seed, ignore_eos=True)
        return tokens(run(make_engine(ckpts["mixtral"]), {"s": (p, params)})["s"])

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_bad_requests_are_input_errors(ckpts):
    engine = make_engine(ckpts["mixtral"], num_blocks=4)
    with pytest.raises(InputError):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(InputError):
        engine.add_request("a", [500], GREEDY)
    with pytest.raises(InputError):
        engine.add_request("a", prompt(15, 1), GREEDY)  # 15 + 8 > 16 tokens of KV


def test_async_engine_streams_and_disconnect_frees_blocks(ckpts):
    engine = make_engine(ckpts["mixtral"])
    baseline = engine.stats()["free_blocks"]
    aeng = AsyncEngine(engine)

    async def main():
        async def full(rid, p):
            return [o async for o in aeng.generate(rid, p, GREEDY)]

        async def disconnect():
            gen = aeng.generate(
                "gone", prompt(20, 14), SamplingParams(max_tokens=200, ignore_eos=True)
            )
            got = [await gen.__anext__() for _ in range(3)]
            await gen.aclose()  # the client goes away mid-stream
            return got

        return await asyncio.gather(full("a", prompt(11, 13)), disconnect())

    try:
        done, partial = asyncio.run(main())
        assert done[-1].finished and len(tokens(done)) == 8 and len(partial) == 3
        for _ in range(200):
            s = aeng.stats()
            if s["free_blocks"] == baseline and s["running"] == 0 and s["queue_depth"] == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert aeng.stats()["free_blocks"] == baseline
    finally:
        aeng.shutdown()
    alone = run(make_engine(ckpts["mixtral"]), {"a": (prompt(11, 13), GREEDY)})["a"]
    assert tokens(done) == tokens(alone)


def test_async_engine_joins_the_deltas_a_slow_reader_left_waiting(ckpts):
    """A reader that comes back after the steps ran gets the waiting deltas as one item: the
    same tokens, text and logprobs as a reader that kept up, in fewer items."""
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    p = prompt(11, 17)
    want = run(make_engine(ckpts["qwen3_moe"]), {"a": (p, params)})["a"]
    aeng = AsyncEngine(make_engine(ckpts["qwen3_moe"]))

    async def slow():
        gen = aeng.generate("a", p, params)
        first = await gen.__anext__()  # the prefill's token
        await asyncio.sleep(1.0)  # meanwhile the step thread finishes the request
        return [first] + [o async for o in gen]

    try:
        got = asyncio.run(slow())
    finally:
        aeng.shutdown()
    assert len(got) < len(want) == 8
    assert tokens(got) == tokens(want)
    assert "".join(o.text_delta for o in got) == "".join(o.text_delta for o in want)
    assert [lp.token_id for o in got for lp in o.logprobs] == tokens(want)
    assert got[-1].finished and got[-1].completion_tokens == 8
