"""`moectl validate MODEL_DIR --reference vllm`: our runtime against vLLM on the same checkpoint.

vLLM exposes no hidden states, so this compares what its API gives (actors/validate/vllm_reference.py):
Step 1: the same deterministic sequences as the transformers reference (`validation_inputs`).
Step 2: vLLM (subprocess in its venv) returns the log-softmax of its final logits at every
        prompt position (full vocabulary) and its greedy continuation of each sequence.
Step 3: our layout (`capture_layout`, the same ranks `validate` runs) gives the lm_head output
        per position; our engine (in-process, one rank) gives our greedy continuation.
Step 4: rel_err = ||log_softmax(ours) - vllm|| / ||vllm|| per sequence and over all; greedy
        tokens must be equal position by position (the first difference is named).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.validate.alignment import DEFAULT_SEQ_LENS, TOLERANCE, preflight, validation_inputs
from cluster.errors import InputError


@dataclass(frozen=True, kw_only=True)
class VllmReport:
    layout: str
    dtype: str
    tolerance: float
    seq_lens: tuple[int, ...]
    rel_err: tuple[float, ...]
    """Per sequence: relative error of our log-softmax against vLLM's, all positions."""
    max_abs_err: float
    top1_agreement: float
    """Share of prompt positions whose most likely next token is the same."""
    ours_greedy: tuple[tuple[int, ...], ...]
    vllm_greedy: tuple[tuple[int, ...], ...]

    @property
    def max_rel_err(self) -> float:
        return max(self.rel_err, default=0.0)

    @property
    def first_greedy_mismatch(self) -> tuple[int, int] | None:
        """(sequence, step) of the first greedy token that differs, else None."""
        for i, (a, b) in enumerate(zip(self.ours_greedy, self.vllm_greedy, strict=True)):
            for step, (x, y) in enumerate(zip(a, b, strict=True)):
                if x != y:
                    return i, step
        return None

    @property
    def passed(self) -> bool:
        return self.max_rel_err <= self.tolerance and self.first_greedy_mismatch is None

    def to_json(self) -> dict:
        return {
            "reference": "vllm",
            "layout": self.layout,
            "dtype": self.dtype,
            "tolerance": self.tolerance,
            "passed": self.passed,
            "seq_lens": list(self.seq_lens),
            "logprobs_rel_err": list(self.rel_err),
            "max_rel_err": self.max_rel_err,
            "max_abs_err": self.max_abs_err,
            "top1_agreement": self.top1_agreement,
            "greedy": {
                "ours": [list(g) for g in self.ours_greedy],
                "vllm": [list(g) for g in self.vllm_greedy],
                "first_mismatch": self.first_greedy_mismatch,
            },
        }


def our_greedy(model_dir: str | Path, sequences: list[list[int]], n: int) -> list[list[int]]:
    """Our engine's greedy continuation of each sequence (in-process, one rank)."""
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams

    longest = max(len(s) for s in sequences) + n
    engine = build_engine(
        model_dir,
        block_size=16,
        num_blocks=len(sequences) * (-(-longest // 16)) + 1,
        max_num_seqs=len(sequences),
        max_num_batched_tokens=max(256, longest),
        tokenizer=None,
    )
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(sequences))}
    for i, seq in enumerate(sequences):
        engine.add_request(str(i), seq, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(sequences))]


def validate_against_vllm(
    model_dir: str | Path,
    *,
    layout: str | None = None,
    reference_dir: str | Path | None = None,
    dtype: str = "float32",
    tolerance: float | None = None,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    seed: int = 0,
    greedy_tokens: int = 8,
    use_ray: bool = False,
    timeout_s: float = 120.0,
) -> VllmReport:
    """Run the four steps of the module docstring; the report says whether it passed.

    vLLM runs `reference_dir` (default `model_dir`); ours runs `model_dir`."""
    from actors.validate.capture import DTYPES, capture_layout
    from actors.validate.vllm_reference import run_vllm_reference

    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if greedy_tokens < 1:
        raise InputError(f"--greedy-tokens {greedy_tokens}: expected at least 1")
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    ref_dir = reference_dir if reference_dir is not None else model_dir
    pre = preflight(model_dir, layout=layout, reference_dir=ref_dir)
    sequences = validation_inputs(pre.arch.vocab_size, seq_lens, seed=seed)
    ref_logprobs, ref_greedy = run_vllm_reference(ref_dir, sequences, greedy_tokens=greedy_tokens)
    ours = capture_layout(
        pre.layout, model_dir, sequences, dtype=dtype, kv_blocks=16, block_size=16,
        use_ray=use_ray, timeout_s=timeout_s,
    )  # fmt: skip
    rel, max_abs, agree, positions = [], 0.0, 0, 0
    for got, ref in zip(ours.outputs["lm_head"], ref_logprobs, strict=True):
        mine = torch.log_softmax(got.to(torch.float64), dim=-1)
        ref = ref.to(torch.float64)
        finite = torch.isfinite(ref)
        diff = torch.where(finite, mine - ref, torch.zeros_like(ref))
        rel.append(diff.norm().item() / torch.where(finite, ref, 0).norm().item())
        max_abs = max(max_abs, diff.abs().max().item())
        agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
        positions += ref.shape[0]
    return VllmReport(
        layout=pre.layout.dims.shorthand,
        dtype=dtype,
        tolerance=tol,
        seq_lens=tuple(seq_lens),
        rel_err=tuple(rel),
        max_abs_err=max_abs,
        top1_agreement=agree / positions,
        ours_greedy=tuple(tuple(g) for g in our_greedy(model_dir, sequences, greedy_tokens)),
        vllm_greedy=tuple(tuple(g) for g in ref_greedy),
    )
