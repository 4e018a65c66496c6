"""The one-call decode attention on CPU (`attention._batched_decode`): a step where every
sequence decodes one token gathers all contexts at once (padded, masked) instead of one
attention call per sequence. It must give the per-sequence path's results: the same greedy
tokens and log-probabilities within float32 reordering, for GQA and MLA, and it must really be
taken (a step of ragged contexts falls back, a batch-invariant engine never takes it); the
per-sequence reference is every batch treated as ragged (`BATCHED_DECODE_PADDING` 0). These
are the paths where the C decode kernel cannot be built: it is switched off here
(tests/actors/kernels/test_cpu_paged_attention.py tests the kernel).
"""

from __future__ import annotations

import pytest

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.kernels import cpu_attention
from actors.model.layers import attention
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def generate(ckpt, *, batched: bool, calls: list | None = None):
    engine = build_engine(
        ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
        batch_invariant=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    for i, n in enumerate((9, 11, 12, 10)):
        engine.add_request(f"r{i}", prompt(n, 40 + i), params)
    outs: dict[str, list] = {}
    original = attention._batched_decode

    def counted(*args, **kw):
        if calls is not None:
            calls.append(1)
        return original(*args, **kw)

    padding = attention.BATCHED_DECODE_PADDING
    attention.BATCHED_DECODE_PADDING = padding if batched else 0.0
    attention._batched_decode = counted
    cpu_attention.ENABLED[0] = False
    try:
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
    finally:
        attention.BATCHED_DECODE_PADDING = padding
        cpu_attention.ENABLED[0] = True
        attention._batched_decode = original
    return outs


def test_batched_decode_equals_per_sequence_attention(ckpt):
    calls: list = []
    fast = generate(ckpt, batched=True, calls=calls)
    slow = generate(ckpt, batched=False)
    assert calls, "the batched decode path was never taken"
    for rid in slow:
        assert [t for o in fast[rid] for t in o.new_token_ids] == [
            t for o in slow[rid] for t in o.new_token_ids
        ]
        for a, b in zip(fast[rid], slow[rid], strict=True):
            assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=1e-5)


def test_ragged_contexts_run_per_sequence():
    """Padding two 3-token contexts to 1,000 slots would waste the work: no batched call."""
    from types import SimpleNamespace

    import torch

    q = torch.zeros(2, 4, 8)
    ragged = SimpleNamespace(context_lens=(3, 3, 1000), query_lens=(1, 1, 1))
    even = SimpleNamespace(context_lens=(900, 1000), query_lens=(1, 1))
    prefill = SimpleNamespace(context_lens=(900, 1000), query_lens=(1, 2))
    assert not attention._batched_decode_suits(q, ragged, None)
    assert attention._batched_decode_suits(q, even, None)
    assert not attention._batched_decode_suits(q, even, 128)  # sliding window
    assert not attention._batched_decode_suits(q, prefill, None)
