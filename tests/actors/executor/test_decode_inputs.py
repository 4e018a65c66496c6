"""The decode step's host-side pieces: its inputs packed into one buffer (one upload a step) and
the greedy choice in two passes over the vocabulary (lowest id on a tie, as the sampler)."""

from __future__ import annotations

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
