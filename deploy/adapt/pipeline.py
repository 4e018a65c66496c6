"""`moectl adapt`: the steps that turn a new model's config (and checkpoint) into a verdict.

Step 1 parse: ModelSpec, operator inventory through the registry, the runtime family (ArchConfig).
Step 2 operator checks: each mapped operator against a float64 reference (`operator_checks`).
Step 3 small-scale alignment: a shrunk model of the same family built by transformers, run by
our runtime in distributed layouts and compared layer by layer (`actors.validate.alignment`); when the
directory holds safetensors, every tensor name and shape against what our loader maps.
Step 4 plan: the memory plan and layout for the real size on the topology, with runners-up.
Step 5 verdict: `ready` only when every operator is supported on the target, every operator check
is within tolerance, the alignment ran and passed in every layout, the checkpoint (if any) maps
completely and the plan fits. Every reason names the operator, tensor, layer or topology concerned.

Default topology (no --topology): the project's example clusters, smallest first
(hgx-h200-8gpu, then hgx-h200-2node-ib, then hgx-h200-4node-ib); the first one a layout fits on is
used and the report says so. The machine running adapt is not the serving cluster.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.errors import InputError

DEFAULT_TOPOLOGIES = ("hgx-h200-8gpu", "hgx-h200-2node-ib", "hgx-h200-4node-ib")
DEFAULT_LAYOUTS = ("ep2", "tp2xpp2")
GENERIC_LAYOUTS = ("single", "pp2", "ep2")
"""The default layouts of a family the generic path runs (whole layers: no tensor parallelism)."""
GENERIC_COST = (
    "runs through the generic path: transformers' own decoder layers over the paged KV cache "
    "(continuous batching, prefix cache, tiers, pipeline stages, expert parallelism), without "
    "tensor parallelism and without the native fused kernels and CUDA graphs"
)
HYBRID_COST = (
    "; its {n} linear-attention layers keep a state per sequence (actors/model/linear_state.py), "
    "a prefix cached with a state snapshot where a chunk ended on its last block (prefill "
    "chunks cut at block boundaries; not with several DP ranks), through our gated delta rule "
    "(actors/kernels/delta_rule.py, Triton on CUDA)"
)
DSA_COST = (
    "; its {n} DeepSeek Sparse Attention layers keep indexer keys beside the KV "
    "(actors/model/sparse_index.py) and attend to their top-k tokens as a masked dense product "
    "per sequence, on the paged path (no CUDA fast decode); index keys go to the tiers from one "
    "process only (not over Ray ranks)"
)
MLA_COST = (
    "; its latent attention (MLA) is cached expanded to keys and values per head, both at the "
    "larger head size: {x:.1f}x the latent's bytes a token"
)
ALIGNMENT_SEQ_LENS = (40, 33, 21)


@dataclass(frozen=True, kw_only=True)
class Reason:
    """Why a model is not ready: `kind` (family, operator, operator-check, alignment, tensor,
    plan, input) and the `subject` it names."""

    kind: str
    subject: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind} {self.subject}: {self.message}"


@dataclass(frozen=True, kw_only=True)
class AdaptOptions:
    topology: str | None = None
    """Topology YAML path or example name; None: the DEFAULT_TOPOLOGIES ladder."""
    context: int | None = None
    """Tokens per sequence to plan for; None: the model's maximum."""
    target: str = "cuda"
    registry: dict[str, dict[str, str]] | None = None
    """Operator registry (placement.operators.REGISTRY when None)."""
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS
    op_budget: int | None = None
    """Weight elements per operator check (operator_checks.DEFAULT_BUDGET when None)."""
    seed: int = 0


@dataclass(kw_only=True)
class AdaptResult:
    source: str
    spec: Any
    config: dict
    options: AdaptOptions
    inventory: list = field(default_factory=list)
    runtime_family: str | None = None
    runtime_path: str | None = None
    """"native" (our layers) or "generic" (transformers' layers, actors/model/generic.py)."""
    linear_layers: int = 0
    """Layers keeping a state per sequence (linear attention), on the generic path."""
    indexed_layers: int = 0
    """DeepSeek Sparse Attention layers, on the generic path."""
    mla_expansion: float = 0.0
    """KV bytes a token the generic path keeps for an MLA model over the latent's (0: no MLA)."""
    runtime_error: str | None = None
    checks: list = field(default_factory=list)
    alignment: list[dict] = field(default_factory=list)
    alignment_skipped: str | None = None
    shrunk_config: dict | None = None
    checkpoint: dict | None = None
    plan: Any = None
    plan_error: str | None = None
    topology: str | None = None
    topology_source: str = ""
    context: int = 0
    reasons: list[Reason] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.reasons:
            return "needs-work"
        return "ready-generic" if self.runtime_path == "generic" else "ready"


def text_config(config: dict) -> dict:
    """The language model's config dict (a multimodal wrapper's text_config)."""
    from placement.model_types import MULTIMODAL

    mt = config.get("model_type")
    if mt in MULTIMODAL and isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.setdefault("model_type", MULTIMODAL[mt])
        return text
    return config


def adapt(path: str | Path, options: AdaptOptions = AdaptOptions(), progress=None) -> AdaptResult:
    """Run the five steps of the module docstring on a config.json or a checkpoint directory.

    Inputs (config, context, topology) are checked before any step runs (InputError); `progress`,
    when given, is called with the name of each step as it starts."""
    from placement.model_spec import read_config
    from placement.model_types import load_model_spec

    config, _ = read_config(path)
    spec = load_model_spec(path)
    context = options.context or spec.max_context or 4096
    if spec.max_context and context > spec.max_context:
        raise InputError(
            f"--context {context} exceeds the model's maximum of {spec.max_context} tokens"
        )
    topologies = list(_topologies(options.topology))
    result = AdaptResult(
        source=str(path), spec=spec, config=config, options=options, context=context
    )
    steps = (
        ("parse", lambda: _parse(result)),
        ("operator_checks", lambda: _operator_checks(result)),
        ("alignment", lambda: _alignment(result)),
        ("checkpoint", lambda: _checkpoint(result, Path(path))),
        ("plan", lambda: _plan(result, topologies)),
    )
    for name, step in steps:
        if progress is not None:
            progress(name)
        _timed(result, name, step)
    return result


def _timed(result: AdaptResult, name: str, fn) -> None:
    t0 = time.perf_counter()
    fn()
    result.timings_s[name] = round(time.perf_counter() - t0, 3)


# ----------------------------------------------------------------------------- steps


def _parse(r: AdaptResult) -> None:
    from actors.model.arch import ArchConfig, is_native
    from actors.model.generic import generic_check
    from deploy.adapt.needs import needs
    from placement.operators import operator_inventory

    r.inventory = operator_inventory(r.spec, r.options.target, r.options.registry)
    text = text_config(r.config)
    try:
        if is_native(text.get("model_type")):
            r.runtime_family = ArchConfig.from_hf(text, source=r.source).family
            r.runtime_path = "native"
        else:  # transformers' own layers, where their attention suits the paged cache
            arch = generic_check(text, r.source)
            r.runtime_family, r.runtime_path = arch.family, "generic"
            r.linear_layers = len(arch.linear_layers)
            r.indexed_layers = len(arch.indexed_layers)
            if text.get("kv_lora_rank"):
                latent = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
                r.mla_expansion = 2 * arch.num_kv_heads * arch.head_dim / latent
    except InputError as exc:
        r.runtime_error = str(exc)
        r.reasons.append(Reason(kind="family", subject=str(text.get("model_type")),
                                message=f"the runtime cannot build this model ({exc})"))  # fmt: skip
    if r.runtime_path == "generic":
        return  # every operator runs as transformers wrote it: none of ours to check
    for use in r.inventory:
        if not use.supported:
            r.reasons.append(Reason(
                kind="operator", subject=use.name,
                message=f"no implementation on {r.options.target} ({use.count} uses); needs {needs(use.name)}",
            ))  # fmt: skip


def _operator_checks(r: AdaptResult) -> None:
    from deploy.adapt.operator_checks import (
        DEFAULT_BUDGET,
        CheckContext,
        OperatorCheck,
        check_arch,
        run_checks,
    )  # fmt: skip

    if r.runtime_path == "generic":
        return
    text = text_config(r.config)
    ctx = CheckContext(spec=r.spec, config=text, arch=check_arch(r.spec, text),
                       budget=r.options.op_budget or DEFAULT_BUDGET, seed=r.options.seed)  # fmt: skip
    checks = []
    for use in r.inventory:
        try:
            checks += run_checks(ctx, [use])
        except (InputError, RuntimeError, ValueError, StopIteration) as exc:
            checks.append(OperatorCheck(operator=use.name, implementation=use.implementation,
                                        ran="-", rel_err_fp32=None, rel_err_fp64=None,
                                        note=f"the check could not run: {exc}"))  # fmt: skip
    r.checks = checks
    for c in checks:
        if c.passed:
            continue
        if c.rel_err_fp32 is None:
            msg = c.note
        else:
            msg = (f"float32 rel err {c.rel_err_fp32:.2e} (tolerance {c.tolerance_fp32:.0e}), float64 "
                   f"{_fmt(c.rel_err_fp64)} (tolerance {c.tolerance_fp64:.0e}) on {c.ran}")  # fmt: skip
        r.reasons.append(Reason(kind="operator-check", subject=c.operator, message=msg))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _alignment(r: AdaptResult) -> None:
    from actors.executor.rank_runner import RankFailed
    from actors.validate.alignment import validate
    from deploy.adapt.shrink import build_shrunk_checkpoint

    if r.runtime_family is None:
        r.alignment_skipped = "the runtime has no family for this model (see the family reason)"
        return
    if not r.options.layouts:
        r.alignment_skipped = "no layout requested"
        r.reasons.append(Reason(kind="alignment", subject="layouts",
                                message="the small-scale alignment did not run (no layout given)"))  # fmt: skip
        return
    generic = r.runtime_path == "generic"
    layouts = r.options.layouts
    if generic and layouts == DEFAULT_LAYOUTS:
        layouts = GENERIC_LAYOUTS
    with tempfile.TemporaryDirectory(prefix="moectl-adapt-") as tmp:
        r.shrunk_config = build_shrunk_checkpoint(
            text_config(r.config), Path(tmp), seed=r.options.seed, generic=generic
        )
        for layout in layouts:
            try:
                rep = validate(tmp, layout=layout, seq_lens=ALIGNMENT_SEQ_LENS, seed=r.options.seed)
            except (InputError, RankFailed) as exc:
                r.alignment.append(
                    {"layout": layout, "passed": False, "error": str(exc).splitlines()[0]}
                )
                r.reasons.append(Reason(kind="alignment", subject=layout,
                                        message=f"the layout did not run: {str(exc).splitlines()[0]}"))  # fmt: skip
                continue
            data = rep.to_json()
            r.alignment.append({k: data.get(k) for k in (
                "layout", "dtype", "tolerance", "passed", "max_rel_err", "seq_lens", "layers",
                "first_divergence", "router_agreement", "expert_coverage", "num_experts")})  # fmt: skip
            first = rep.first_divergence
            if first is not None:
                where = first.module if first.layer is None else f"layer {first.layer} {first.op}"
                r.reasons.append(Reason(
                    kind="alignment", subject=first.module,
                    message=(f"{layout}: first divergence at {where}, rel err {first.rel_err:.2e} > "
                             f"{rep.tolerance:g} (shrunk model, transformers reference)"),
                ))  # fmt: skip


def _checkpoint(r: AdaptResult, path: Path) -> None:
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return
    if r.runtime_path == "generic":
        r.checkpoint = {"checked": False, "note": "the generic path reads tensors through "
                        "transformers' key conversions, which name a missing one at load"}  # fmt: skip
        return
    from deploy.adapt.tensor_check import check_checkpoint

    r.checkpoint = check_checkpoint(path, runtime_ok=r.runtime_family is not None)
    for name, problem in r.checkpoint["problems"]:
        r.reasons.append(Reason(kind="tensor", subject=name, message=problem))


def _plan(r: AdaptResult, topologies: list) -> None:
    from placement.plan import plan
    from placement.strategy import Workload

    workload = Workload(context=r.context)
    for name, topo, source in topologies:
        r.topology, r.topology_source = name, source
        try:
            r.plan = plan(r.spec, topo, workload, whole_layers=r.runtime_path == "generic")
            r.plan_error = None
            return
        except InputError as exc:
            r.plan_error = str(exc)
    r.reasons.append(
        Reason(kind="plan", subject=r.topology or "-", message=r.plan_error or "no plan")
    )


def _topologies(given: str | None):
    from cluster.topology_file import example_names, load_example, load_topology

    if given is None:
        for name in DEFAULT_TOPOLOGIES:
            yield name, load_example(name), "default (project example; --topology to choose)"
        return
    p = Path(given)
    if p.is_file():
        topo = load_topology(p)
        yield topo.name, topo, f"given ({given})"
    elif given.removesuffix(".yaml") in example_names():
        name = given.removesuffix(".yaml")
        yield name, load_example(name), f"given (project example {name})"
    else:
        raise InputError(
            f"--topology {given}: no such file or project example ({', '.join(example_names())})"
        )


def summary(r: AdaptResult) -> dict:
    """The JSON summary (report/summary.json, `--json`)."""
    from deploy.adapt.needs import needs

    spec = r.spec
    p = r.plan
    errs = [c.rel_err_fp32 for c in r.checks if c.rel_err_fp32 is not None]
    align = [a["max_rel_err"] for a in r.alignment if "max_rel_err" in a]
    worst = max(errs + align) if errs or align else None
    moe = next((layer.ffn for layer in spec.layers if layer.is_moe), None)
    return {
        "model": r.source,
        "model_type": spec.model_type,
        "family": spec.family,
        "verdict": r.verdict,
        "reasons": [str(x) for x in r.reasons],
        "reason_details": [dataclasses.asdict(x) for x in r.reasons],
        "max_rel_err": worst,
        "operator_max_rel_err": max(errs) if errs else None,
        "alignment_max_rel_err": max(align) if align else None,
        "tp": p.dims.tp if p else None,
        "pp": p.dims.pp if p else None,
        "ep": p.dims.ep if p else None,
        "dp": p.dims.dp if p else None,
        "etp": p.dims.etp if p else None,
        "num_gpus": p.dims.world if p else None,
        "target": r.options.target,
        "topology": {"name": r.topology, "source": r.topology_source},
        "context": r.context,
        "runtime_family": r.runtime_family,
        "runtime_path": r.runtime_path,
        "runtime_cost": (
            GENERIC_COST
            + (HYBRID_COST.format(n=r.linear_layers) if r.linear_layers else "")
            + (DSA_COST.format(n=r.indexed_layers) if r.indexed_layers else "")
            + (MLA_COST.format(x=r.mla_expansion) if r.mla_expansion else "")
            if r.runtime_path == "generic"
            else None
        ),
        "runtime_error": r.runtime_error,
        "model_facts": {
            "num_layers": spec.num_layers,
            "moe_layers": len(spec.moe_layers),
            "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size,
            "num_experts": moe.num_experts if moe else 0,
            "top_k": moe.top_k if moe else 0,
            "total_params": spec.total_params,
            "active_params": spec.active_params,
            "weight_bytes": spec.weight_bytes(),
            "kv_bytes_per_token": spec.kv_bytes_per_token(),
            "state_bytes_per_sequence": spec.state_bytes_per_sequence,
            "max_context": spec.max_context,
            "quantization": spec.quantization.method,
        },
        "operators": [
            {**u.to_dict(), "needs": None if u.supported else needs(u.name)} for u in r.inventory
        ],
        "operator_checks": [c.to_json() for c in r.checks],
        "alignment": {
            "ran": bool(r.alignment),
            "skipped": r.alignment_skipped,
            "layouts": r.alignment,
            "shrunk_config": r.shrunk_config,
        },
        "checkpoint": r.checkpoint,
        "plan": None
        if p is None
        else {
            "fits": p.fits,
            "layout": _layout_name(p),
            "memory": p.to_json()["memory"],
            "predicted": p.to_json()["predicted"],
            "kv_capacity_tokens": p.kv_capacity_tokens,
            "max_sequences": p.max_sequences,
            "replicas": p.replicas,
            "alternatives": [dataclasses.asdict(a) for a in p.alternatives],
            "workload": dataclasses.asdict(p.workload),
        },
        "plan_error": r.plan_error,
        "tensors": tensor_shapes(spec),
        "timings_s": r.timings_s,
    }


def _layout_name(p) -> str:
    d = p.dims
    parts = [f"tp{d.tp}", f"pp{d.pp}", f"dp{d.dp}", f"ep{d.ep}"]
    return "x".join(parts + ([f"etp{d.etp}"] if d.etp > 1 else []))


def tensor_shapes(spec) -> dict[str, list]:
    """Tensor name pattern (layer index as {i}) -> distinct [shape, copies, layers] of the spec."""
    import re

    out: dict[str, dict[tuple, int]] = {}
    for t in spec.top_level + tuple(x for layer in spec.layers for x in layer.tensors):
        key = re.sub(r"\.layers\.\d+\.", ".layers.{i}.", t.name)
        shapes = out.setdefault(key, {})
        shapes[(tuple(t.shape), t.copies)] = shapes.get((tuple(t.shape), t.copies), 0) + 1
    return {k: [[list(s), c, n] for (s, c), n in v.items()] for k, v in out.items()}
