"""The paged KV path (chunked prefill + decode over scattered blocks) against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from actors.engine.sampler import RowSampling
from actors.executor.runner import LocalRunner
from actors.executor.step import StepInput
from actors.kv.cache import slots_for
from tests.actors.checkpoints import load_reference, make_tiny_checkpoint, reference_logits

TOL = 1e-4
CASES = {
    "deepseek_v3": ("deepseek_v3", {}),
    "mixtral": ("mixtral", {}),
    "mixtral_window": ("mixtral", {"sliding_window": 6}),
    "qwen3_moe": ("qwen3_moe", {}),
}


def _chunks(length, first):
    out, done = list(first), sum(first)
    out += [1] * (length - done)
    return out


def teacher_forced(runner, seqs, chunk_plans, *, block_size=4, num_blocks=40, per_sequence=False):
    """Feed each sequence in the given chunks, all sequences in the same steps; logits per seq."""
    runner.allocate_kv(num_blocks, block_size)
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables, offset = [], 0
    for s in seqs:
        n = -(-len(s) // block_size)
        tables.append(tuple(ids[offset : offset + n]))
        offset += n
    done = [0] * len(seqs)
    plans = [list(p) for p in chunk_plans]
    out = [[] for _ in seqs]
    while any(plans):
        active = [i for i, p in enumerate(plans) if p]
        lens = [plans[i].pop(0) for i in active]
        toks, pos, slots = [], [], []
        for i, n in zip(active, lens, strict=True):
            toks.append(seqs[i][done[i] : done[i] + n])
            pos.append(torch.arange(done[i], done[i] + n))
            slots += slots_for(tables[i], done[i], done[i] + n, block_size)
        step = StepInput(
            token_ids=torch.cat(toks),
            positions=torch.cat(pos),
            query_lens=tuple(lens),
            context_lens=tuple(done[i] + n for i, n in zip(active, lens, strict=True)),
            block_tables=tuple(tables[i] for i in active),
            slot_mapping=torch.tensor(slots),
            sample_seqs=(),
            sampling=(),
            per_sequence=per_sequence,
        )
        logits = runner.forward(step, all_rows=True)
        for i, part in zip(active, torch.split(logits, lens), strict=True):
            out[i].append(part)
            done[i] += part.shape[0]
    return [torch.cat(o) for o in out], tables


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    path = make_tiny_checkpoint(
        family, tmp_path_factory.mktemp(request.param), num_hidden_layers=2, **overrides
    )
    ref = load_reference(path)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (37, 30)]
    return path, seqs, reference_logits(ref, seqs)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_paged_chunked_logits_match_transformers(case):
    path, seqs, ref = case
    runner = LocalRunner.from_checkpoint(path)
    plans = [_chunks(37, (13, 9)), _chunks(30, (5, 16))]
    ours, _ = teacher_forced(runner, seqs, plans)
    for o, r in zip(ours, ref, strict=True):
        assert _rel(o, r) < TOL


def test_a_wrong_block_table_breaks_alignment(case):
    """Mutation: the last token reads its second-to-last block from the wrong (empty) block.

    (A permuted table would not do: keys carry their rotary positions, and the last query sees
    the whole context, so attention over it is invariant to the order of the blocks.)"""
    path, seqs, ref = case
    runner = LocalRunner.from_checkpoint(path)
    seq, n = seqs[0], len(seqs[0])
    _, tables = teacher_forced(runner, [seq[:-1]], [_chunks(n - 1, (13, 9))])
    table = tables[0]
    unused = [b for b in range(40) if b not in table]
    if len(table) * 4 < n:
        table = (*table, unused.pop())

    def last(tab):
        step = StepInput(
            token_ids=seq[-1:],
            positions=torch.tensor([n - 1]),
            query_lens=(1,),
            context_lens=(n,),
            block_tables=(tab,),
            slot_mapping=torch.tensor(slots_for(tab, n - 1, n, 4)),
            sample_seqs=(0,),
            sampling=(RowSampling(temperature=0, top_k=0, top_p=1, seed=0, step=0),),
        )
        return runner.forward(step)[0]

    assert _rel(last(table), ref[0][-1]) < TOL
    i = (n - 1) // 4 - 1  # inside the sliding window too
    wrong = (*table[:i], unused[0], *table[i + 1 :])
    assert _rel(last(wrong), ref[0][-1]) > 100 * TOL
