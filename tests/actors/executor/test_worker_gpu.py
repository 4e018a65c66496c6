"""On a CUDA GPU: a ShardWorker's decode micro-batches replay CUDA graphs through the code of
LocalRunner's decode step (`run_decode`), for a whole-model rank and for a later pipeline stage
(hidden states in). Skips without CUDA."""

from __future__ import annotations

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
            assert list(graphs.graphs) == [(4, 32)]
    for eager, replayed in zip(outs[False], outs[True], strict=True):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[True][0], outs[True][1])
    for block in range(4):
        torch.testing.assert_close(caches[1].read_block(block), caches[0].read_block(block))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_cuda_rank_actor_replays_decode_graphs_with_the_in_process_tokens(family, tmp_path):
    """The multi-rank path on one GPU as `moectl serve` runs it: an engine over a Replica of one
    ShardWorker Ray actor (its own process, the step channel) gives the greedy tokens of the
    in-process LocalRunner engine (bfloat16 as served; prompts that hit the prefix cache, whose
    short tails run as decode rows), and the rank replayed CUDA graphs (none refused)."""
    ray = pytest.importorskip("ray")
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams
    from tests.actors.engine.test_engine import prompt

    path = make_tiny_checkpoint(family, tmp_path / family)
    shared = prompt(40, 0)
    prompts = {"a": shared + prompt(6, 1), "b": prompt(33, 2), "c": shared + prompt(3, 3)}
    kw = dict(num_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=3,
              batch_invariant=False, device="cuda", dtype="bfloat16")  # fmt: skip
    got, health = {}, None
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        for layout in (None, "single"):
            ranks = {"layout": layout, "num_cpus": 1, "num_gpus": 1} if layout else {}
            engine = build_engine(path, **ranks, **kw)
            out: dict[str, list[int]] = {}
            for k, (rid, ids) in enumerate(prompts.items()):
                engine.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True))
                for _ in range(3 * k):  # later requests join a running batch
                    for o in engine.step():
                        out.setdefault(o.request_id, []).extend(o.new_token_ids)
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
            got[layout] = out
            if layout:
                health = engine.runner.health()
                engine.runner.shutdown()
    finally:
        ray.shutdown()
    assert got["single"] == got[None] and all(len(t) == 12 for t in got[None].values())
    assert health[0]["graph_error"] is None and health[0]["graphs"] >= 1, health
