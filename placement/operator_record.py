"""Operator record of a model: every module call of one forward pass, in order, with its shapes.

Why: the parameter tree says what a model holds, the forward says what it runs and in which
order. Forward hooks on every module record (path, class, input/output shapes and dtypes), the
enclosing call and the calls whose outputs each call consumes (by tensor identity), so a new
family's operators and their dependencies can be read without reading its modelling code.

The pass runs on the meta device first (no memory; transformers' bf16 grouped-mm experts work
there). Where a data-dependent op breaks on meta, it runs again on a shrunk copy of the config
(a prefix of the layers holding two of each distinct layer, few experts, small widths) on the
CPU in float32 with random weights, and the record says so in `mode` and `note`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from placement.config_fields import ConfigFields
from placement.meta_model import MetaModel, build_meta_model

SEQ_LEN = 4
"""Tokens of the recorded forward pass."""
MAX_SHRUNK_LAYERS = 8

_RECOGNISED = re.compile(
    r"Attention|Attn|MLA|Mamba|DeltaNet|Lightning|Mixer|MLP|Mlp|MoE|Moe|Experts|Router|Gate|Gating|"
    r"Norm|Embedding|Linear|Conv1d|Identity|Act|SiLU|GELU|Rotary|DecoderLayer|Block|Model|"
    r"ForCausalLM|ModuleList|Dropout|Sequential"
)
"""Classes whose operator the planner models (or that only structure the tree)."""


@dataclass(frozen=True, kw_only=True)
class OpCall:
    """One module call of the forward pass."""

    index: int
    """Call order (at entry); the model's own call is 0."""
    path: str
    """Module path in the tree, e.g. `model.layers.3.mlp.experts` ("" for the model)."""
    class_name: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    """(shape, dtype) of each tensor argument, positional then keyword."""
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    parent: int | None
    """Index of the enclosing call (the caller module), None for the model."""
    inputs_from: tuple[int, ...]
    """Indices of the calls that produced this call's input tensors (data dependencies: by tensor
    identity, and by storage off the meta device; a tensor computed outside any module call, e.g.
    a residual add, links to nothing)."""

    def to_dict(self) -> dict:
        return {"index": self.index, "path": self.path, "class": self.class_name,
                "inputs": [[list(s), d] for s, d in self.inputs],
                "outputs": [[list(s), d] for s, d in self.outputs],
                "parent": self.parent, "inputs_from": list(self.inputs_from)}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class OperatorRecord:
    """The calls of one forward pass and how they were obtained."""

    mode: str
    """"meta" (the config as given, on the meta device), "shrunk-cpu-fp32" (a shrunk copy on the
    CPU with random weights) or "partial" (both failed: the calls up to the failure)."""
    note: str
    calls: tuple[OpCall, ...] = field(default=())

    def summary(self) -> dict:
        """What `moectl model inspect --json` prints: distinct classes, calls per class, and the
        module calls of classes the planner does not recognise (`path: Class`, first of each)."""
        counts = Counter(c.class_name for c in self.calls)
        unrecognised: dict[str, str] = {}
        for c in self.calls:
            if not _RECOGNISED.search(c.class_name) and c.class_name not in unrecognised:
                unrecognised[c.class_name] = f"{c.path}: {c.class_name}"
        return {
            "mode": self.mode, "note": self.note, "calls": len(self.calls),
            "distinct_classes": len(counts), "calls_per_class": dict(sorted(counts.items())),
            "unrecognised": list(unrecognised.values()),
        }  # fmt: skip


def record_operators(top: ConfigFields, meta: MetaModel | None = None) -> OperatorRecord:
    """The operator record of a config.json (see the module docstring for the fallback)."""
    import torch

    meta = meta or build_meta_model(top)
    vocab = meta.model.get_input_embeddings().weight.shape[0]
    calls: list[OpCall] = []
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta")
    meta_error = ""
    partial: tuple[OpCall, ...] = ()
    for use_cache in (None, False):  # some hybrids' caches break on meta, others' masks without
        calls = []
        try:
            _record(meta.model, ids, calls, use_cache=use_cache)
            return OperatorRecord(mode="meta", note="one forward on the meta device",
                                  calls=tuple(calls))  # fmt: skip
        # Any op of any modelling file may refuse meta tensors; each refusal means "fall back".
        except Exception as exc:
            meta_error = meta_error or _one_line(exc)
            partial = partial or tuple(calls)
    try:
        small, what = _shrunk_config(meta)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
        calls = []
        vocab = model.get_input_embeddings().weight.shape[0]
        _record(model, torch.randint(0, vocab, (1, SEQ_LEN)), calls)
    except Exception as exc:  # the shrunk copy is a best effort
        return OperatorRecord(
            mode="partial",
            note=f"meta forward failed ({meta_error}); the shrunk CPU copy failed too "
            f"({_one_line(exc)}): calls up to the meta failure",
            calls=partial,
        )
    return OperatorRecord(
        mode="shrunk-cpu-fp32",
        note=f"meta forward failed ({meta_error}); recorded on a shrunk copy ({what}) on the CPU "
        "in float32 with random weights",
        calls=tuple(calls),
    )


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def _tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _info(tensors: list) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)


def _keys(t: Any) -> tuple:
    """Producer keys of a tensor: its identity, and on a real device its storage, so that a view
    (the ForCausalLM's hidden_states[:, -n:]) still points at the call that wrote it; meta
    tensors have no storage, so there only identity links calls."""
    if t.is_meta:
        return (id(t),)
    return id(t), ("storage", t.untyped_storage().data_ptr())


def _record(model: Any, input_ids: Any, calls: list[OpCall], use_cache: bool | None = None) -> None:
    """Run one forward of `model` with hooks on every module, appending to `calls`."""
    import torch

    producer: dict[object, int] = {}
    keep: list = []  # tensors stay alive so that their ids are not reused during the pass
    stack: list[int] = []
    pending: dict[int, dict] = {}
    handles = []

    def pre(path: str):
        def hook(module, args, kwargs):
            tensors = _tensors(args) + _tensors(kwargs)
            keep.extend(tensors)
            index = len(pending)
            pending[index] = {
                "path": path, "class_name": type(module).__name__, "inputs": _info(tensors),
                "parent": stack[-1] if stack else None,
                "inputs_from": tuple(sorted({producer[k] for t in tensors for k in _keys(t)
                                             if k in producer})),
            }  # fmt: skip
            stack.append(index)

        return hook

    def post(module, args, kwargs, output):
        index = stack.pop()
        tensors = _tensors(output)
        keep.extend(tensors)
        for t in tensors:
            for k in _keys(t):
                producer[k] = index
        pending[index]["outputs"] = _info(tensors)

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            kwargs = {} if use_cache is None else {"use_cache": use_cache}
            model(input_ids=input_ids, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for index in sorted(pending):
            entry = pending[index]
            calls.append(OpCall(index=index, outputs=entry.get("outputs", ()), **{
                k: v for k, v in entry.items() if k != "outputs"}))  # fmt: skip


_SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32, "ffn_hidden_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "index_head_dim": 16,
    "index_n_heads": 2, "sliding_window": 4, "max_position_embeddings": 256,
}  # fmt: skip
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts")


def _shrunk_config(meta: MetaModel) -> tuple[Any, str]:
    """A copy of the language model's config small enough to run on the CPU, and what changed.

    Step 1: the shortest prefix of layers holding two of each distinct layer (by the classes of
    its children), at most MAX_SHRUNK_LAYERS; per-layer lists are cut to it.
    Step 2: at most 4 experts, top-k at most 2, one expert group.
    Step 3: widths from _SMALL where the config has the field.
    """
    from transformers import AutoConfig

    from placement.meta_model import _decoder_layers

    cfg = meta.model.config
    data = cfg.to_dict()
    _, layers = _decoder_layers(meta.model)
    seen: Counter = Counter()
    keep = len(layers)
    kinds = {tuple(type(c).__name__ for c in layer.children()) for layer in layers}
    for i, layer in enumerate(layers):
        seen[tuple(type(c).__name__ for c in layer.children())] += 1
        if all(seen[k] >= 2 for k in kinds):
            keep = i + 1
            break
    keep = min(keep, MAX_SHRUNK_LAYERS)
    n = data.get("num_hidden_layers")
    for key, value in list(data.items()):
        if isinstance(value, list) and isinstance(n, int) and len(value) == n:
            data[key] = value[:keep]
    data["num_hidden_layers"] = keep
    for key in _EXPERTS:
        if isinstance(data.get(key), int):
            data[key] = min(data[key], 4)
    for key in _TOPK:
        if isinstance(data.get(key), int):
            data[key] = min(data[key], 2)
    for key in ("n_group", "topk_group", "num_expert_group"):
        if isinstance(data.get(key), int):
            data[key] = 1
    for key, value in _SMALL.items():
        if isinstance(data.get(key), int):
            data[key] = value
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if data.get(key) is not None:
            data[key] = 0
    data.pop("quantization_config", None)
    data.pop("per_layer_config", None)
    model_type = data.pop("model_type", cfg.model_type)
    return AutoConfig.for_model(model_type, **data), f"{keep} layers, <= 4 experts, hidden 64"
