"""On a CUDA GPU: a ShardWorker's decode micro-batches replay CUDA graphs through the code of
LocalRunner's decode step (`run_decode`), for a whole-model rank and for a later pipeline stage
(hidden states in). Skips without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from tests.actors.checkpoints import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_later_stage_replays_its_graph_from_hidden_states(tmp_path):
    """A stage that is neither first nor last (hidden states in and out), three sequences (the
    graph's batch padded to four with copies of row 0): the replayed graph gives the eager
    forward's output, a second replay with new inputs too (the static input is refilled), and
    the K/V it wrote equal the eager run's, the padded rows' included."""
    from actors.kernels.decode_step import DecodeGraphs, graph_batch, run_decode
    from actors.kv.cache import KVCache, KVLayout
    from actors.model.weights import load_stage_model

    assert [graph_batch(b) for b in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 24, 32]
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "m")
    model, _ = load_stage_model(path, layer_range=(1, 2), device="cuda")
    assert not model.first and not model.last
    arch = model.arch
    layout = KVLayout.for_stage(arch, block_size=16, layer_range=(1, 2), dtype=torch.float32)
    tables = [[0], [1, 2], [3]]
    caches, outs = [], {}
    for graphed in (False, True):
        cache = KVCache(layout, 8, "cuda")
        caches.append(cache)
        graphs = DecodeGraphs(model, cache, use_triton=False) if graphed else None
        outs[graphed] = []
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            hidden = torch.randn(3, arch.hidden_size, generator=gen).cuda()
            lens = [5 + step, 17 + step, 2 + step]
            slots = [
                t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, lens, strict=True)
            ]
            out = run_decode(
                model, cache, tokens=torch.zeros(3, dtype=torch.int64),
                positions=torch.tensor([n - 1 for n in lens]), slots=torch.tensor(slots),
                tables=tables, context_lens=lens, graphs=graphs, use_triton=False, x=hidden,
            )  # fmt: skip
            assert out.shape == (3, arch.hidden_size)
            outs[graphed].append(out.clone())
        if graphed:
            assert graphs.error is None and graphs.captures == 1
            assert list(graphs.graphs) == [(4, 32, False)]
    for eager, replayed in zip(outs[False], outs[True], strict=True):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[True][0], outs[True][1])
    for block in range(4):
        torch.testing.assert_close(caches[1].read_block(block), caches[0].read_block(block))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_decode_rows_replay_a_graph_of_their_own_with_the_eager_results(family, tmp_path):
    """Decode rows (several new tokens of one sequence, `shared_rows`): five rows, three of one
    sequence, padded to eight; the replayed graph gives the eager step's logits and writes the
    K/V the eager step writes, a second step with other rows too; its graph is not the pure
    decode graph of the same batch and width (a decode step after it captures its own)."""
    from actors.kernels.decode_step import DecodeGraphs, run_decode
    from actors.kv.cache import KVCache, KVLayout
    from actors.model.weights import load_stage_model

    path = make_tiny_checkpoint(family, tmp_path / "m")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    # bfloat16 as served (float32 experts take a padded path that reads counts on the host).
    model, _ = load_stage_model(path, layer_range=(0, layers), device="cuda", dtype=torch.bfloat16)
    layout = KVLayout.for_stage(
        model.arch, block_size=16, layer_range=(0, layers), dtype=torch.bfloat16
    )
    blocks, outs = [], {}
    for graphed in (False, True):
        cache = KVCache(layout, 8, "cuda")
        graphs = DecodeGraphs(model, cache, use_triton=True) if graphed else None
        outs[graphed] = []
        for step in range(2):
            # Sequence 0 (blocks 1, 2): three new tokens at 26 + 3 step...; 1 and 2 one each.
            seq_rows = [(0, 26 + 3 * step + j) for j in range(3)] + [(1, 4 + step), (2, 9 + step)]
            tables = {0: [1, 2], 1: [0], 2: [3]}
            pos = [p for _, p in seq_rows]
            gen = torch.Generator().manual_seed(step)
            out = run_decode(
                model, cache, tokens=torch.randint(0, model.arch.vocab_size, (5,), generator=gen),
                positions=torch.tensor(pos),
                slots=torch.tensor([tables[s][p // 16] * 16 + p % 16 for s, p in seq_rows]),
                tables=[tables[s] for s, _ in seq_rows], context_lens=[p + 1 for p in pos],
                graphs=graphs, use_triton=True, shared_rows=True,
            )  # fmt: skip
            outs[graphed].append(out.clone())
        blocks.append([cache.read_block(b).clone() for b in range(4)])
        if graphed:
            assert graphs.error is None and list(graphs.graphs) == [(8, 32, True)]
            run_decode(
                model, cache, tokens=torch.zeros(5, dtype=torch.int64),
                positions=torch.tensor([3] * 5), slots=torch.tensor([b * 16 + 3 for b in range(3, 8)]),
                tables=[[b] for b in range(3, 8)], context_lens=[4] * 5,
                graphs=graphs, use_triton=True,
            )  # fmt: skip
            assert sorted(graphs.graphs) == [(8, 32, False), (8, 32, True)]
    for eager, replayed in zip(outs[False], outs[True], strict=True):
        torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
    assert not torch.equal(outs[True][0], outs[True][1])
    for graphed_block, eager_block in zip(blocks[1], blocks[0], strict=True):
        torch.testing.assert_close(graphed_block, eager_block)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_cuda_rank_actor_replays_decode_graphs_with_the_in_process_tokens(family, tmp_path):
    """The multi-rank path on one GPU as `moectl serve` runs it: an engine over a Replica of one
    ShardWorker Ray actor (its own process, the step channel) gives the greedy tokens of the
    in-process LocalRunner engine (bfloat16 as served; prompts that hit the prefix cache, whose
    short tails run as decode rows), and its seeded sampled tokens, and the rank replayed CUDA
    graphs (none refused), every one captured by the start-up warm-up: none while the requests
    ran (`actors/engine/warm_up.py`)."""
    ray = pytest.importorskip("ray")
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams
    from tests.actors.engine.test_engine import prompt

    path = make_tiny_checkpoint(family, tmp_path / family)
    # And each prompt sampled as clients do (seeded): the same draws from the same logits.
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.95, seed=7)
    shared = prompt(40, 0)
    prompts = {"a": shared + prompt(6, 1), "b": prompt(33, 2), "c": shared + prompt(3, 3)}
    kw = dict(num_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=6,
              batch_invariant=False, device="cuda", dtype="bfloat16")  # fmt: skip
    got, health = {}, None
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        for layout in (None, "single"):
            ranks = {"layout": layout, "num_cpus": 1, "num_gpus": 1} if layout else {}
            engine = build_engine(path, **ranks, **kw)

            def captures(engine=engine, layout=layout):
                if layout:
                    return engine.runner.health()[0]["graph_captures"]
                return engine.stats()["graph_captures"]

            warmed = captures()
            assert warmed > 0 and engine.stats()["warm_up_steps"] > 0
            out: dict[str, list[int]] = {}
            for k, (rid, ids) in enumerate(prompts.items()):
                engine.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True))
                engine.add_request(rid + "-t", ids, sampled)
                for _ in range(3 * k):  # later requests join a running batch
                    for o in engine.step():
                        out.setdefault(o.request_id, []).extend(o.new_token_ids)
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
            got[layout] = out
            assert captures() == warmed, layout
            if layout:
                health = engine.runner.health()
                engine.runner.shutdown()
    finally:
        ray.shutdown()
    assert got["single"] == got[None] and all(len(t) == 12 for t in got[None].values())
    assert len(got[None]) == 6
    assert health[0]["graph_error"] is None and health[0]["graphs"] >= 1, health
