"""The engine step on the wire: a fixed binary layout for `ShardStep` and `ShardStepOutput`.

Every engine step crosses the driver -> worker boundary once per rank and comes back once per
rank. Ray pickles what it is given with a Python-level hook per object, so a step made of tuples,
dataclasses and one `RowSampling` per row costs more to send than a model forward of a decode
token on a small shard. Here the step is one `bytes` of little-endian int64 words (floats as
their float64 bit patterns), and so is each rank's answer: Ray (plain calls or the compiled
graph's shared-memory channel) moves one buffer without looking inside. Nothing is unpickled.

Step layout (int64 words; S sequences, T new tokens, R sampled rows, N block-table entries,
C block copies):

    header [8]       MAGIC_STEP, S, T, R, N, C, flags (bit 0: per_sequence, bit 1: state
                     slots, bit 2: state snapshot ops), P
    token_ids [T]    positions [T]    slot_mapping [T]
    query_lens [S]   context_lens [S] owners [S]       table_lens [S]
    tables [N]       every sequence's block table, one after another
    state_slots [S]  (flag bit 1 only) each sequence's linear-attention state slot
    snapshots        (flag bit 2 only) n_restores, n_saves, then (row, slot) pairs to restore
                     before the step and (slot, row) pairs to save after it
    sample_seqs [R]  top_k [R]  seed [R]  step [R]  logprobs [R] (-1: None)
    output_lens [R]  prompt_lens [R]  (the penalty tokens each row carries)
    temperature [R]  top_p [R]  min_p [R]  presence [R]  frequency [R]  repetition [R]
                     float64 bit patterns
    penalty ids [P]  each row's output_ids then prompt_ids, one row after another
    copies [3C]      (block, src, dst) triples

A seed is carried as its low 64 bits (`seed mod 2**64`, the only bits `sampler.uniform` reads),
so the decoded `RowSampling.seed` is that residue and every draw is the same.

Output layout (one rank's `ShardStepOutput`):

    header [8]       MAGIC_OUT, rank, n (rows), K (timings), L (logprob words), B (key bytes), 0, 0
    rows [n]         token_ids [n]
    timings [K]      float64 bit patterns, in the order of the key names
    logprobs [L]     per row: -1 (None), or k, token_id, logprob (f64 bits), then k pairs
                     (token_id, logprob f64 bits)
    key names        B bytes, ASCII, comma-separated, zero-padded to a multiple of 8
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from actors.engine.sampler import RowSampling, TokenLogprob
from actors.executor.step import StepInput

MAGIC_STEP = 0x5354455031
"""First word of a packed step ("STEP1")."""
MAGIC_OUT = 0x4F55545031
"""First word of a packed rank output ("OUTP1")."""
HEADER = 8
_ROW_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
ROW_WORDS = 7 + len(_ROW_FLOATS)
_U64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """`value mod 2**64` as a signed int64 (the bits a uint64 would hold)."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def _f64_words(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).view(np.int64)


def pack_step(step: StepInput, owners, copies=()) -> bytes:
    """One `ShardStep` (the engine's step, the owner DP rank of each sequence, the KV block
    copies to run first) as bytes in the layout of the module docstring."""
    s, t, r = len(step.query_lens), int(step.token_ids.shape[0]), len(step.sample_seqs)
    table_lens = [len(b) for b in step.block_tables]
    n, c = sum(table_lens), len(copies)
    rows = step.sampling
    p = sum(len(row.output_ids) + len(row.prompt_ids) for row in rows)
    st = s if step.state_slots else 0
    ops = [*chain.from_iterable(step.state_restores), *chain.from_iterable(step.state_saves)]
    snap = 2 + len(ops) if ops else 0
    words = np.empty(
        HEADER + 3 * t + 4 * s + n + st + snap + ROW_WORDS * r + p + 3 * c, dtype=np.int64
    )
    flags = int(step.per_sequence) | (2 if st else 0) | (4 if snap else 0)
    words[:HEADER] = (MAGIC_STEP, s, t, r, n, c, flags, p)
    at = HEADER
    for tensor in (step.token_ids, step.positions, step.slot_mapping):
        words[at : at + t] = tensor.numpy()
        at += t
    for values in (step.query_lens, step.context_lens, owners, table_lens):
        words[at : at + s] = values
        at += s
    words[at : at + n] = np.fromiter(chain.from_iterable(step.block_tables), np.int64, n)
    at += n
    if st:
        words[at : at + s] = step.state_slots
        at += s
    if snap:
        words[at : at + snap] = [len(step.state_restores), len(step.state_saves), *ops]
        at += snap
    words[at : at + r] = step.sample_seqs
    words[at + r : at + 2 * r] = [row.top_k for row in rows]
    words[at + 2 * r : at + 3 * r] = [_int64(row.seed) for row in rows]
    words[at + 3 * r : at + 4 * r] = [row.step for row in rows]
    words[at + 4 * r : at + 5 * r] = [-1 if row.logprobs is None else row.logprobs for row in rows]
    words[at + 5 * r : at + 6 * r] = [len(row.output_ids) for row in rows]
    words[at + 6 * r : at + 7 * r] = [len(row.prompt_ids) for row in rows]
    for k, name in enumerate(_ROW_FLOATS):
        words[at + (7 + k) * r : at + (8 + k) * r] = _f64_words(
            [getattr(row, name) for row in rows]
        )
    at += ROW_WORDS * r
    if p:
        words[at : at + p] = np.fromiter(
            chain.from_iterable(chain(row.output_ids, row.prompt_ids) for row in rows),
            np.int64,
            p,
        )
        at += p
    words[at : at + 3 * c] = list(chain.from_iterable(copies))
    return words.tobytes()


def unpack_step(blob: bytes) -> tuple[StepInput, tuple[int, ...], tuple[tuple[int, int, int], ...]]:
    """(step, owners, copies) from `pack_step`'s bytes. The step's tensors are int64 views of
    one writable copy of the buffer."""
    words = np.frombuffer(blob, dtype=np.int64).copy()
    magic, s, t, r, n, c, flags, p = words[:HEADER].tolist()
    if magic != MAGIC_STEP:
        raise ValueError(f"packed step: first word {magic:#x}, expected {MAGIC_STEP:#x}")
    at = HEADER
    tensors = []
    for _ in range(3):
        tensors.append(torch.from_numpy(words[at : at + t]))
        at += t
    lists = []
    for _ in range(4):
        lists.append(words[at : at + s].tolist())
        at += s
    query_lens, context_lens, owners, table_lens = lists
    flat = words[at : at + n].tolist()
    at += n
    tables, start = [], 0
    for length in table_lens:
        tables.append(tuple(flat[start : start + length]))
        start += length
    state_slots: tuple[int, ...] = ()
    if flags & 2:
        state_slots = tuple(words[at : at + s].tolist())
        at += s
    restores: tuple = ()
    saves: tuple = ()
    if flags & 4:
        nr, ns = words[at : at + 2].tolist()
        pairs = words[at + 2 : at + 2 + 2 * (nr + ns)].tolist()
        restores = tuple(tuple(pairs[i : i + 2]) for i in range(0, 2 * nr, 2))
        saves = tuple(tuple(pairs[i : i + 2]) for i in range(2 * nr, 2 * (nr + ns), 2))
        at += 2 + 2 * (nr + ns)
    sample_seqs = words[at : at + r].tolist()
    top_k, seed, index, logprobs, output_lens, prompt_lens = (
        words[at + k * r : at + (k + 1) * r].tolist() for k in range(1, 7)
    )
    floats = {
        name: words[at + (7 + k) * r : at + (8 + k) * r].view(np.float64).tolist()
        for k, name in enumerate(_ROW_FLOATS)
    }
    at += ROW_WORDS * r
    penalty_ids = words[at : at + p].tolist()
    at += p
    flat_copies = words[at : at + 3 * c].tolist()
    sampling, start = [], 0
    for i in range(r):
        mid, stop = start + output_lens[i], start + output_lens[i] + prompt_lens[i]
        sampling.append(
            RowSampling(
                **{name: values[i] for name, values in floats.items()},
                top_k=top_k[i],
                seed=seed[i] & _U64,
                step=index[i],
                logprobs=None if logprobs[i] < 0 else logprobs[i],
                output_ids=tuple(penalty_ids[start:mid]),
                prompt_ids=tuple(penalty_ids[mid:stop]),
            )
        )
        start = stop
    sampling = tuple(sampling)
    step = StepInput(
        token_ids=tensors[0],
        positions=tensors[1],
        query_lens=tuple(query_lens),
        context_lens=tuple(context_lens),
        block_tables=tuple(tables),
        slot_mapping=tensors[2],
        sample_seqs=tuple(sample_seqs),
        sampling=sampling,
        per_sequence=bool(flags & 1),
        state_slots=state_slots,
        state_restores=restores,
        state_saves=saves,
    )
    copies = tuple(tuple(flat_copies[i : i + 3]) for i in range(0, 3 * c, 3))
    return step, tuple(owners), copies


def _logprob_words(logprobs) -> list[int]:
    out: list[int] = []
    for lp in logprobs:
        if lp is None:
            out.append(-1)
            continue
        out += (len(lp.top), lp.token_id, 0)
        at = len(out) - 1
        floats = [lp.logprob]
        for token, value in lp.top:
            out += (token, 0)
            floats.append(value)
        # Fill the float slots with their bit patterns (positions at, at + 2, at + 4, ...).
        bits = _f64_words(floats).tolist()
        for k, word in enumerate(bits):
            out[at + 2 * k] = word
    return out


def pack_output(rank: int, rows, token_ids, logprobs, timings_s: dict[str, float]) -> bytes:
    """One rank's answer to a step (`ShardStepOutput`'s fields) as bytes."""
    n = len(rows)
    lp_words = _logprob_words(logprobs) if any(lp is not None for lp in logprobs) else []
    keys = ",".join(timings_s).encode("ascii")
    key_words = -(-len(keys) // 8)
    k, m = len(timings_s), len(lp_words)
    words = np.zeros(HEADER + 2 * n + k + m + key_words, dtype=np.int64)
    words[:HEADER] = (MAGIC_OUT, rank, n, k, m, len(keys), 0, 0)
    at = HEADER
    words[at : at + n] = rows
    words[at + n : at + 2 * n] = token_ids
    at += 2 * n
    words[at : at + k] = _f64_words(list(timings_s.values()))
    at += k
    words[at : at + m] = lp_words
    at += m
    buf = words.view(np.uint8)
    buf[8 * at : 8 * at + len(keys)] = np.frombuffer(keys, dtype=np.uint8)
    return words.tobytes()


def unpack_output(blob: bytes):
    """(rank, rows, token_ids, logprobs, timings_s) from `pack_output`'s bytes; logprobs holds
    one `TokenLogprob | None` per row."""
    words = np.frombuffer(blob, dtype=np.int64)
    magic, rank, n, k, m, nkeys, _, _ = words[:HEADER].tolist()
    if magic != MAGIC_OUT:
        raise ValueError(f"packed output: first word {magic:#x}, expected {MAGIC_OUT:#x}")
    at = HEADER
    rows = tuple(words[at : at + n].tolist())
    token_ids = tuple(words[at + n : at + 2 * n].tolist())
    at += 2 * n
    values = words[at : at + k].view(np.float64).tolist()
    at += k
    logprobs: tuple[TokenLogprob | None, ...] = (None,) * n
    if m:
        logprobs = _read_logprobs(words[at : at + m], n)
    at += m
    names = bytes(blob[8 * at : 8 * at + nkeys]).decode("ascii").split(",") if k else []
    return rank, rows, token_ids, logprobs, dict(zip(names, values, strict=True))


def _read_logprobs(words: np.ndarray, n: int) -> tuple[TokenLogprob | None, ...]:
    ints = words.tolist()
    floats = words.view(np.float64).tolist()
    out: list[TokenLogprob | None] = []
    at = 0
    for _ in range(n):
        top = ints[at]
        if top < 0:
            out.append(None)
            at += 1
            continue
        token, logprob = ints[at + 1], floats[at + 2]
        pairs = tuple((ints[at + 3 + 2 * j], floats[at + 4 + 2 * j]) for j in range(top))
        out.append(TokenLogprob(token_id=token, logprob=logprob, top=pairs))
        at += 3 + 2 * top
    return tuple(out)
