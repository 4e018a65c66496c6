"""`moectl validate`: our layout against transformers, operator by operator, and memory vs the plan.

Step 1 (preflight, nothing computed): open both checkpoints, parse the layout (or read a Plan),
check the degrees against the model, and list every rank's shares against the checkpoint, so a
missing tensor, a wrong shape or a layout for another model is one InputError naming the tensor,
the rank or the degree.
Step 2: transformers runs the reference checkpoint (float32, eager attention) on deterministic
token ids (>= 2 sequences of different lengths) with forward hooks (`actors.validate.reference`).
Step 3: our ranks run the same ids (`actors.validate.capture`), each capturing its own layers and sequences.
Step 4: per module output, rel_err = ||ours - ref|| / ||ref|| over all tokens of all sequences,
in forward order; the first entry above the tolerance is the first divergence. Router logits are
compared like any output; the expert choice agreement (tokens whose top-k set matches) is reported.
Step 5: each rank's measured weights and KV region next to the planner's prediction for the same
layout (`placement.plan.predict_memory`, or the memory plan of a given Plan file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.validate.capture import DTYPES, LayoutCapture, capture_layout
from cluster.errors import InputError
from placement.parallel_dims import Layout, parse_layout

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
FLIP_BUDGET = {"float32": 0.0, "bfloat16": 0.05}
"""Share of tokens whose expert choice may differ from the reference's at one router."""
"""Default relative tolerance per compute dtype; the reference always runs in float32. bf16 rounds
weights and activations to 8 mantissa bits (unit roundoff 2^-9 = 2.0e-3), several roundings per
operator, accumulated over the layers: the tiny test models measure 1.2e-2 to 2.2e-2 after four
layers, so 5e-2 leaves room without hiding a wrong operator (those show 1e-1 and more)."""
WEIGHTS_TOLERANCE = 0.02
KV_TOLERANCE = 0.05
DEFAULT_SEQ_LENS = (40, 33, 21)

# (module suffix inside a decoder layer, op name), in forward order.
_LAYER_OPS = (
    ("self_attn", "attention"),
    ("mlp.gate", "router"),
    ("mlp.experts", "experts"),
    ("mlp.shared_experts", "shared_experts"),
    ("mlp", "mlp"),
    ("", "output"),
)


@dataclass(frozen=True, kw_only=True)
class OpError:
    """Relative error of one module output."""

    layer: int | None
    """Decoder layer as numbered in the checkpoint (None for embedding, final norm, lm_head)."""
    op: str
    """attention, router, experts, shared_experts, mlp, output, embedding, norm, lm_head."""
    module: str
    """The Hugging Face module name (`model.layers.3.mlp.experts`)."""
    rel_err: float
    max_abs_err: float
    tokens: int
    """Tokens compared (all, less those whose routing flipped in an earlier router)."""
    ok: bool
    """Within the tolerance; a router also needs each routing flip within the flip budget or
    a near tie (`flips_beyond_ties` 0)."""
    flips: int = 0
    """Router: tokens (of `tokens`) whose expert set differs from the reference's."""
    flips_beyond_ties: int | None = None
    """Router: flips the logits' own difference cannot explain (see `beyond_ties`); None where
    the reference's choice is not a plain top-k of its logits (bias, group-limited routing)."""


@dataclass(frozen=True, kw_only=True)
class ValidationReport:
    layout: str
    dtype: str
    tolerance: float
    seq_lens: tuple[int, ...]
    errors: tuple[OpError, ...]
    router_agreement: dict[int, float]
    """MoE layer -> fraction of tokens whose chosen expert set equals the reference's."""
    expert_coverage: dict[int, int]
    """MoE layer -> experts that received at least one token (summed over ranks)."""
    num_experts: int
    ranks: tuple[dict, ...]
    """Per rank: coordinates, timings, per-op latency, memory measured vs predicted."""
    memory_note: str | None = None
    """Why the planner's prediction is missing (it could not read the model), else None."""

    @property
    def first_divergence(self) -> OpError | None:
        return next((e for e in self.errors if not e.ok), None)

    @property
    def max_rel_err(self) -> float:
        return max((e.rel_err for e in self.errors), default=0.0)

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    @property
    def memory_ok(self) -> bool | None:
        """Every rank within tolerance of the plan; None when there is no plan to compare with."""
        if self.memory_note is not None:
            return None
        return all(r["memory"][k]["ok"] for r in self.ranks for k in ("weights", "kv_cache"))

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "layout": self.layout,
            "dtype": self.dtype,
            "tolerance": self.tolerance,
            "passed": self.passed,
            "max_rel_err": self.max_rel_err,
            "seq_lens": list(self.seq_lens),
            "num_experts": self.num_experts,
            "expert_coverage": {str(k): v for k, v in self.expert_coverage.items()},
            "router_agreement": {str(k): v for k, v in self.router_agreement.items()},
            "layers": [
                {
                    "layer": e.layer,
                    "op": e.op,
                    "module": e.module,
                    "rel_err": e.rel_err,
                    "max_abs_err": e.max_abs_err,
                    "tokens": e.tokens,
                    "ok": e.ok,
                }
                for e in self.errors
            ],
            "first_divergence": None
            if first is None
            else {
                "layer": first.layer,
                "op": first.op,
                "module": first.module,
                "rel_err": first.rel_err,
            },
            "memory_ok": self.memory_ok,
            "memory_note": self.memory_note,
            "ranks": list(self.ranks),
        }


def validation_inputs(
    vocab_size: int, seq_lens: Sequence[int] = DEFAULT_SEQ_LENS, *, seed: int = 0
) -> list[list[int]]:
    """Deterministic token ids: one sequence per length, uniform over the vocabulary."""
    if len(seq_lens) < 2 or len(set(seq_lens)) < 2 or min(seq_lens) < 1:
        raise InputError(
            f"--seq-lens {list(seq_lens)}: give at least two positive lengths that differ "
            "(data-parallel attention must see different sequences)"
        )
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in seq_lens]


# ----------------------------------------------------------------------------- preflight


@dataclass(frozen=True, kw_only=True)
class Preflight:
    layout: Layout
    arch: object
    planned_memory: tuple | None
    """The DeviceMemory of each stage from a Plan file, or None (predicted here)."""


def preflight(
    model_dir: str | Path,
    *,
    layout: str | None = None,
    plan_file: str | Path | None = None,
    reference_dir: str | Path | None = None,
) -> Preflight:
    """Every check that needs no computation; InputError (one line) on the first problem."""
    from actors.model.layers.moe import LocalDispatch
    from actors.model.stage import StageModel
    from actors.model.weights import CheckpointIndex, check_shares

    index = CheckpointIndex.open(model_dir)
    arch = index.arch()
    planned = None
    if plan_file is not None:
        if layout is not None:
            raise InputError("give --layout or --plan, not both")
        plan = load_plan(plan_file)
        lay = plan.layout
        if lay.num_layers != arch.num_layers or lay.num_experts != arch.num_experts:
            raise InputError(
                f"plan {plan_file} is for a model with {lay.num_layers} layers and "
                f"{lay.num_experts} experts ({plan.model}); {model_dir} has {arch.num_layers} "
                f"layers and {arch.num_experts} experts"
            )
        planned = plan.memory
    else:
        dims = parse_layout(layout or "single")
        dims.check_model(
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            num_experts=arch.num_experts,
        )
        lay = Layout.build(dims, num_layers=arch.num_layers, num_experts=arch.num_experts)
    dims = lay.dims
    dims.check_model(
        num_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        num_experts=arch.num_experts,
    )
    if dims.etp != 1:
        raise InputError(f"etp={dims.etp}: expert tensor parallelism is not implemented yet")
    if arch.generic:  # transformers' own layers: their loader names a missing tensor
        from actors.model.generic import refuse_tp

        refuse_tp(arch, dims.tp, str(model_dir))
        return Preflight(layout=lay, arch=arch, planned_memory=planned)
    # Every rank's boxes against the checkpoint, on the meta device (nothing allocated or read).
    for rank in range(dims.world):
        c = dims.coords(rank)
        bounds = lay.layer_range(c.pp)
        sliced = dims.ep > 1 and arch.num_experts > 0
        stage = StageModel(
            arch,
            layer_range=(bounds.start, bounds.stop),
            first=c.pp == 0,
            last=c.pp == dims.pp - 1,
            tp_rank=c.tp,
            tp_size=dims.tp,
            local_experts=lay.local_experts(dims.ep_rank(rank)) if sliced else None,
            ep=LocalDispatch() if sliced else None,
            device="meta",
        )
        check_shares(stage.shares(index), index, rank=rank)
    if reference_dir is not None and Path(reference_dir) != Path(model_dir):
        ref = CheckpointIndex.open(reference_dir).arch()
        for field in ("family", "num_layers", "hidden_size", "vocab_size", "num_experts"):
            if getattr(ref, field) != getattr(arch, field):
                raise InputError(
                    f"reference {reference_dir} has {field}={getattr(ref, field)}, "
                    f"{model_dir} has {getattr(arch, field)}"
                )
    return Preflight(layout=lay, arch=arch, planned_memory=planned)


def load_plan(path: str | Path):
    """A Plan from `moectl plan --json` / `-o plan.yaml` output; InputError when unreadable."""
    import json

    import yaml

    from placement.plan import Plan

    p = Path(path)
    if not p.is_file():
        raise InputError(f"--plan {p}: no such file")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise InputError(f"--plan {p}: not JSON/YAML ({type(exc).__name__})") from None
    return Plan.from_json(data, origin=f"--plan {p}")


# ----------------------------------------------------------------------------- comparison


def compare(
    reference: dict[str, list[torch.Tensor]],
    ours: dict[str, list[torch.Tensor]],
    num_layers: int,
    *,
    tolerance: float,
    flip_budget: float = 0.0,
) -> tuple[list[OpError], dict[int, float]]:
    """Relative error per module output in forward order, and router agreement per MoE layer.

    A token whose chosen expert set differs from the reference's (a routing flip) is compared no
    further: from that layer's experts on, the reference is no longer its target. The router op
    fails when its logits are off, or when more than `flip_budget` of the tokens flipped (0 in
    float32; reduced precision may flip near-ties) and a flip is not a near tie: one whose
    reference margin the two runs' logits difference could not bridge (`beyond_ties`).
    """
    order: list[tuple[int | None, str, str]] = [(None, "embedding", "model.embed_tokens")]
    for i in range(num_layers):
        base = f"model.layers.{i}"
        for suffix, op in _LAYER_OPS:
            order.append((i, op, f"{base}.{suffix}" if suffix else base))
    order += [(None, "norm", "model.norm"), (None, "lm_head", "lm_head")]
    errors: list[OpError] = []
    agreement: dict[int, float] = {}
    kept: torch.Tensor | None = None
    for layer, op, name in order:
        if name not in reference:
            continue
        if name not in ours:
            raise RuntimeError(f"our model produced no {name} while transformers did")
        ref = torch.cat(reference[name]).to(torch.float64)
        got = torch.cat(ours[name]).to(torch.float64)
        if ref.shape != got.shape:
            raise RuntimeError(
                f"{name}: our shape {list(got.shape)}, transformers {list(ref.shape)}"
            )
        if kept is None:
            kept = torch.ones(ref.shape[0], dtype=torch.bool)
        ref, got = ref[kept], got[kept]
        diff = (got - ref).norm().item()
        scale = ref.norm().item()
        rel = diff / scale if scale > 0 else diff
        max_abs = (got - ref).abs().max().item() if ref.numel() else 0.0
        ok, flipped, tie = rel <= tolerance, 0, None
        ids = f"{name}.topk_ids"
        if op == "router" and ids in reference and ids in ours:
            a = torch.cat(reference[ids]).sort(dim=-1).values
            b = torch.cat(ours[ids]).sort(dim=-1).values
            same = (a == b).all(dim=-1)
            agreement[layer] = same.float().mean().item()
            flipped = int((kept & ~same).sum())
            ids_kept = torch.cat(reference[ids])[kept]
            tie = beyond_ties(ref, got, ids_kept, (~same)[kept])
            ok = ok and (flipped <= flip_budget * int(kept.sum()) or tie == 0)
            kept = kept & same
        errors.append(
            OpError(
                layer=layer, op=op, module=name, rel_err=rel, max_abs_err=max_abs,
                tokens=int(ref.shape[0]), ok=ok, flips=flipped, flips_beyond_ties=tie,
            )
        )  # fmt: skip
    return errors, agreement


def beyond_ties(
    ref: torch.Tensor, got: torch.Tensor, ref_ids: torch.Tensor, flipped: torch.Tensor
) -> int | None:
    """Of the `flipped` tokens (bool [T]), those whose routing flip the router logits cannot
    explain: swapping expert i of the reference's choice for an unchosen j needs
    got_i < got_j while ref_i >= ref_j, i.e. err_j - err_i >= ref_i - ref_j >= the margin
    (the lowest chosen minus the highest unchosen reference logit), so a flip needs
    margin <= 2 max|got - ref| over the token's logits. A flip with a wider margin means the
    experts were picked from other scores than the logits compared: a bug. None where the
    reference's choice is not the plain top-k of `ref` (a bias or group limits chose)."""
    if ref.dim() != 2 or ref_ids.shape[0] != ref.shape[0]:
        return None
    chosen = torch.zeros_like(ref, dtype=torch.bool).scatter_(1, ref_ids.long(), True)
    inf = torch.tensor(float("inf"), dtype=ref.dtype)
    margin = torch.where(chosen, ref, inf).amin(-1) - torch.where(chosen, -inf, ref).amax(-1)
    if bool((margin < -1e-6 * ref.abs().amax(-1)).any()):
        return None
    err = (got - ref).abs().amax(-1)
    return int((flipped & (margin > 2 * err)).sum())


# ----------------------------------------------------------------------------- memory


def predicted_memory(
    model_dir: str | Path, layout: Layout, *, dtype: str, kv_tokens: int, prefill_tokens: int
):
    """[pp] the planner's DeviceMemory for this layout with weights and KV held in `dtype`."""
    from placement.model_types import load_model_spec
    from placement.plan import predict_memory

    label = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    spec = dataclasses.replace(load_model_spec(model_dir), weight_dtype=label)
    return predict_memory(
        spec,
        layout,
        hbm_bytes=141 * 10**9,
        context=kv_tokens,
        prefill_tokens=prefill_tokens,
        kv_dtype=label,
    )


def _within(measured: int, predicted: float | None, tol: float) -> dict:
    if predicted is None:
        return {"measured": measured, "predicted": None, "rel_diff": None, "ok": None}
    rel = abs(measured - predicted) / predicted if predicted else float(measured != 0)
    return {"measured": measured, "predicted": int(predicted), "rel_diff": rel, "ok": rel <= tol}


def rank_entries(capture: LayoutCapture, stages: Sequence | None) -> tuple[dict, ...]:
    """Per rank: coordinates, timings, op latencies, and memory measured vs predicted.

    Predicted KV = tokens the rank's KV region was allocated for x the plan's KV bytes per token
    of its stage (its layers, its TP share); predicted weights = the stage's weight region.
    """
    out = []
    for r in capture.ranks:
        plan = stages[r.pp] if stages is not None else None
        m = r.memory_bytes
        kv_pred = r.kv_tokens * plan.kv_bytes_per_token if plan is not None else None
        comm = {k.removeprefix("wait_"): v for k, v in r.timings_s.items() if k.startswith("wait_")}
        out.append(
            {
                "rank": r.rank,
                "pp": r.pp,
                "dp": r.dp,
                "tp": r.tp,
                "layers": list(r.layers),
                "timings_s": {k: v for k, v in r.timings_s.items() if not k.startswith("wait_")},
                "comm_s": comm,
                "op_latency_s": r.op_latency_s,
                "memory": {
                    "weights": _within(
                        m["weights"], plan.weights if plan else None, WEIGHTS_TOLERANCE
                    ),
                    "kv_cache": _within(m["kv_cache"], kv_pred, KV_TOLERANCE),
                    "activations": {
                        "measured": m.get("activations_peak"),
                        "predicted": plan.activations if plan else None,
                    },
                    "workspace": {"measured": None, "predicted": plan.workspace if plan else None},
                    "buffers": {"measured": m.get("buffers", 0)},
                },
            }
        )
    return tuple(out)


# ----------------------------------------------------------------------------- entry point


def validate(
    model_dir: str | Path,
    *,
    layout: str | None = None,
    plan_file: str | Path | None = None,
    reference_dir: str | Path | None = None,
    dtype: str = "float32",
    tolerance: float | None = None,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    seed: int = 0,
    kv_tokens: int = 256,
    block_size: int = 16,
    use_ray: bool = False,
    timeout_s: float = 120.0,
    device: str = "cpu",
) -> ValidationReport:
    """Run the five steps of the module docstring; the report says whether it passed.
    `device` "cuda": our ranks on this host's GPUs (one each, NCCL); the reference stays on the
    CPU in float32."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    if kv_tokens < block_size or kv_tokens % block_size:
        raise InputError(f"--kv-tokens {kv_tokens}: expected a positive multiple of {block_size}")
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    if not tol > 0:
        raise InputError(f"--tolerance {tolerance}: expected a positive number")
    ref_dir = reference_dir if reference_dir is not None else model_dir
    pre = preflight(model_dir, layout=layout, plan_file=plan_file, reference_dir=ref_dir)
    arch = pre.arch
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if use_ray or pre.layout.dims.world > gpus:
            raise InputError(
                f"--device cuda: layout {pre.layout.dims.shorthand} needs "
                f"{pre.layout.dims.world} GPUs of this host, it has {gpus}"
                + (" (and --ray runs CPU ranks only)" if use_ray else "")
            )
    tokens = validation_inputs(arch.vocab_size, seq_lens, seed=seed)

    from actors.validate.reference import load_reference_model, reference_capture

    ref_model = load_reference_model(ref_dir)
    ours = capture_layout(
        pre.layout,
        model_dir,
        tokens,
        dtype=dtype,
        kv_blocks=kv_tokens // block_size,
        block_size=block_size,
        use_ray=use_ray,
        timeout_s=timeout_s,
        device=device,
    )
    reference = reference_capture(ref_model, tokens)
    del ref_model
    errors, agreement = compare(
        reference, ours.outputs, arch.num_layers, tolerance=tol, flip_budget=FLIP_BUDGET[dtype]
    )

    coverage: dict[int, list[int]] = {}
    for r in ours.ranks:
        for layer, counts in r.routed.items():
            acc = coverage.setdefault(int(layer), [0] * len(counts))
            coverage[int(layer)] = [a + c for a, c in zip(acc, counts, strict=True)]
    dims = pre.layout.dims
    per_dp = [sum(len(tokens[s]) for s in range(d, len(tokens), dims.dp)) for d in range(dims.dp)]
    stages, note = pre.planned_memory, None
    if stages is None:
        try:
            stages = predicted_memory(
                model_dir, pre.layout, dtype=dtype, kv_tokens=kv_tokens, prefill_tokens=max(per_dp)
            )
        except InputError as exc:
            # The numerics stand on their own; a planner that cannot read the model is reported.
            note = f"the planner could not read {model_dir}: {exc}"
    return ValidationReport(
        layout=dims.shorthand if plan_file is None else f"{dims.shorthand} (plan {plan_file})",
        dtype=dtype,
        tolerance=tol,
        seq_lens=tuple(seq_lens),
        errors=tuple(errors),
        router_agreement=agreement,
        expert_coverage={k: sum(1 for c in v if c > 0) for k, v in sorted(coverage.items())},
        num_experts=arch.num_experts,
        ranks=rank_entries(ours, stages),
        memory_note=note,
    )
