"""The decode step's host-side pieces: its inputs packed into one buffer (one upload a step) and
the greedy choice in two passes over the vocabulary (lowest id on a tie, as the sampler)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.sampler import RowSampling, sample
from actors.engine.sampler import argmax_lowest as greedy_tokens
from actors.kernels.decode_step import PackedInputs


def test_packed_inputs_round_trip_every_tensor_at_aligned_offsets():
    arrays = {
        "tokens": torch.tensor([5, 9, 11]),
        "block_tables": torch.arange(15, dtype=torch.int32).view(3, 5),  # 60 bytes: padded to 64
        "context_lens": torch.tensor([3, 1, 4], dtype=torch.int32),
    }
    packed = PackedInputs(arrays, pin=False)
    assert [o for _, o, *_ in packed.layout] == [0, 24, 88]
    assert packed.host.numel() == 88 + 16
    views = packed.views(packed.host.clone())  # a copy of the buffer reads back the same
    for name, t in arrays.items():
        assert views[name].dtype == t.dtype and torch.equal(views[name], t), name
    moved = packed.to("cpu")
    assert all(torch.equal(moved[n], t) for n, t in arrays.items())


def test_greedy_tokens_match_argmax_and_the_sampler_on_ties():
    gen = torch.Generator().manual_seed(0)
    for vocab in (129280, 151936, 1000, 97):  # chunked (two sizes) and single-pass vocabularies
        logits = torch.randn(4, vocab, generator=gen).to(torch.bfloat16)
        logits[1, 3] = logits[1, vocab - 2] = 50.0  # a tie across chunks: the lower id wins
        logits[2, vocab // 2] = logits[2, vocab // 2 + 1] = 50.0  # a tie inside a chunk
        logits[3, vocab - 1] = 60.0  # the last id of the last chunk
        got = greedy_tokens(logits).tolist()
        assert got == logits.float().argmax(dim=-1).tolist(), vocab
        assert got[1:] == [3, vocab // 2, vocab - 1]
        rows = (RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0),) * 4
        assert got == sample(logits.float(), rows)[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_short_query_steps_run_as_decode_rows_with_the_paged_tokens(family, tmp_path):
    """Steps that mix decode rows with the short uncached tails of prompts that hit the prefix
    cache (a serving ramp) run on the fast path as one decode row per new token, each attending
    up to its own position: the same greedy tokens as the paged path, GQA and MLA, and the
    short-rows path is taken (a long prompt keeps the paged path)."""
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams
    from actors.executor import runner as runner_mod
    from actors.executor.runner import LocalRunner
    from tests.actors.checkpoints import make_tiny_checkpoint
    from tests.actors.engine.test_engine import prompt

    path = make_tiny_checkpoint(family, tmp_path / family)
    shared = prompt(24, 0)
    script = {0: [("a", shared + prompt(5, 1))], 2: [("b", shared + prompt(7, 2))],
              3: [("c", shared + prompt(3, 3)), ("d", prompt(40, 4))]}  # fmt: skip
    got, taken = {}, {}
    for fast in (False, True):
        runner = LocalRunner.from_checkpoint(path)
        runner.fast_decode = fast
        rows = []
        original = runner._decode_rows

        def counted(step, original=original, rows=rows):
            rows.append(tuple(step.query_lens))
            return original(step)

        runner._decode_rows = counted
        engine = build_engine(
            path, runner=runner, num_blocks=64, block_size=4, max_num_batched_tokens=64,
            max_num_seqs=4, batch_invariant=False, async_scheduling=False,
        )  # fmt: skip
        out: dict[str, list[int]] = {}
        k = 0
        while engine.has_unfinished() or k <= max(script):
            for rid, ids in script.get(k, ()):
                engine.add_request(rid, ids, SamplingParams(max_tokens=6, ignore_eos=True))
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            k += 1
        got[fast], taken[fast] = out, rows
    assert got[True] == got[False] and len(got[True]) == 4
    assert not taken[False]
    mixed = [lens for lens in taken[True] if max(lens) > 1]
    assert mixed, taken[True]  # a tail beside decode rows took the short-rows path
    assert all(max(lens) <= runner_mod.SHORT_QUERY for lens in taken[True])
