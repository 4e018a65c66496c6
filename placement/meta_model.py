"""ModelSpec from transformers' own module tree, for model types our family readers do not know.

Why: a hand-written family reader (families.py) is exact, but every new MoE release needs one.
transformers' causal-LM class for a config *is* the reference implementation, and built on the
meta device it costs no memory and well under a second, so its parameter count is exact by
construction. What this module has to recognise is each parameter's role (planner roles of
layer_spec.ROLES) and each layer's token mixer (attention kind and the KV or state it keeps).

Recognition, per decoder layer (the ModuleList of the language model holding most parameters):
- an experts container is a submodule named `experts` or of a class ending in `Experts`; inside
  it a parameter of 2+ dims owned by a fused container (or one entry of a ModuleList of per-expert
  MLPs) is a routed expert (`copies` = its leading dim, or the list's length); one under a
  `router` / `gate` is the router; anything else there is always active (shared);
- a child of the layer that holds an experts container and is not a token mixer is the MoE block:
  its submodules named `*shared*` are shared experts, `*latent*` latent projections, the rest
  (gate, correction bias, router norms) the router;
- a child named like a token mixer (`self_attn`, `linear_attn`, `mamba`, `mixer`, ...) is the
  attention; a child named or classed like an MLP is a dense MLP (`shared_mlp`: a shared expert);
  a norm-classed child is a norm; anything else is "other" (hyper-connections, residual scales);
- every 1-D parameter of a `*Norm` module is a norm.

The attention kind comes from the mixer's class and attributes (MLA: `kv_lora_rank`; Gated
DeltaNet: `num_v_heads`/`head_k_dim`; KDA: `*Delta*`; lightning; Mamba: `ssm_state_size`) and the
window from `config.layer_types` / the module's `sliding_window`; KV elements per token come from
the k/v projection widths themselves, so per-layer head counts (MiMo-V2-Flash) are exact.
Known approximations are listed in `approximations` of the spec's features (`approx:...`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cluster.errors import InputError
from placement.config_fields import ConfigFields
from placement.layer_spec import AttentionSpec, FfnSpec, LayerSpec, TensorSpec
from placement.model_spec import ModelSpec
from placement.quantization import DTYPE_BYTES, parse_quantization

MIXER_NAMES = frozenset(
    {"self_attn", "self_attention", "attention", "attn", "linear_attn", "mamba", "mixer",
     "temporal_block", "token_mixer"}
)  # fmt: skip
"""Child names of a decoder layer that hold its token mixer."""
FFN_NAMES = frozenset(
    {"mlp", "mlps", "feed_forward", "ffn", "block_sparse_moe", "moe", "shared_mlp"}
)
_FFN_CLASS = re.compile(r"MLP|Mlp|FeedForward|MoE|Moe|FFN|Ffn")
_MIXER_CLASS = re.compile(r"Attention|Attn|MLA|Mamba|Mixer|DeltaNet|Lightning")
"""A child named like a mixer is one unless its class reads as an FFN (Nemotron-H names both
`mixer`); family prefixes such as GraniteMoeHybrid are why the mixer words are checked first."""
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token",
               "top_k_experts", "experts_per_token", "moe_top_k", "topk")  # fmt: skip
_NOT_MATMUL = frozenset({"A_log", "D", "dt_bias", "sinks"})
_DROP_FOR_TRANSFORMERS = ("quantization_config", "auto_map")
"""Fields we read ourselves (quantization) or must never act on (remote code)."""


@dataclass(frozen=True)
class MetaModel:
    """A config's causal-LM module tree on the meta device, and what it was built from."""

    config: Any
    """transformers' config object of the whole (possibly multimodal) config.json."""
    model: Any
    """The causal-LM `torch.nn.Module` (bf16 parameters on the meta device)."""


# ----- transformers' side ----------------------------------------------------------------------
def transformers_version() -> str:
    import transformers

    return transformers.__version__


def known_model_types() -> frozenset[str]:
    """Every `model_type` the installed transformers has a config class for."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


def causal_lm_model_types() -> frozenset[str]:
    """Model types with both a config class and a causal-LM class in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return known_model_types() & frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def transformers_config(top: ConfigFields) -> Any:
    """transformers' config object for a config.json; InputError naming model_type when its
    config class rejects the fields."""
    from transformers import AutoConfig

    model_type = top.str("model_type")
    data = {k: v for k, v in top.data.items() if k not in _DROP_FOR_TRANSFORMERS}
    try:
        return AutoConfig.for_model(**data)
    # transformers' config classes raise whatever their validators raise (ValueError, TypeError,
    # KeyError, StrictDataclass errors): each is bad input here, reported on one line.
    except Exception as exc:
        named = re.search(r"field '([\w.]+)'", str(exc))
        if named:  # transformers' validators name the field: name it the way ConfigFields does
            text = " ".join(str(exc).split())
            why = text.split(f"field '{named.group(1)}': ", 1)[-1][:160]
            raise InputError(
                f"{top.label}: field '{top.prefix}{named.group(1)}' is rejected by transformers "
                f"{transformers_version()}'s config for {model_type!r}: {why}"
            ) from None
        raise InputError(
            f"{top.label}: field 'model_type' is {model_type!r}, but transformers "
            f"{transformers_version()} rejects this config: {_one_line(exc)}"
        ) from None


def build_meta_model(top: ConfigFields, config: Any | None = None) -> MetaModel:
    """The causal-LM class of the config built on the meta device (no weights, no memory).

    bf16, so that transformers' grouped-mm expert kernels also run on meta (operator_record)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = config if config is not None else transformers_config(top)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as exc:  # the modelling code raises anything on bad fields
        raise InputError(
            f"{top.label}: field 'model_type' is {top.str('model_type')!r}, but transformers "
            f"{transformers_version()} cannot build its causal LM from this config: {_one_line(exc)}"
        ) from None
    return MetaModel(config=config, model=model)


def unknown_model_type_error(top: ConfigFields, known: str) -> InputError:
    """The one-line error for a model_type neither our families nor transformers know."""
    return top.error(
        "model_type",
        f"a supported model type (our families: {known}; the installed transformers "
        f"{transformers_version()} does not know it either)",
        top.str("model_type"),
    )


# ----- the spec --------------------------------------------------------------------------------
def build_meta_spec(top: ConfigFields, *, source: str, meta: MetaModel | None = None) -> ModelSpec:
    """ModelSpec of a config.json through transformers' module tree (see the module docstring)."""
    meta = meta or build_meta_model(top)
    model = meta.model
    lm_config = model.config
    layers_path, layer_list = _decoder_layers(model)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    seen: set[int] = set()
    approx: set[str] = set()
    layers = []
    for i, layer in enumerate(layer_list):
        layers.append(
            _layer(i, f"{layers_path}.{i}", layer, lm_config, emb.shape[1], seen, approx, top.label)
        )
    top_level = _top_level(model, emb, out.weight if out is not None else None, seen)
    dtype = top.str("torch_dtype", "dtype", default=None) or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise top.error("torch_dtype", f"one of {', '.join(DTYPE_BYTES)}", dtype)
    text = top.section("text_config") or top
    quant = text if text.has("quantization_config") else top
    features = {"meta_model", *(f"approx:{a}" for a in sorted(approx))}
    if any(type(m).__name__ == "LayerNorm" for m in model.modules()):
        features.add("layernorm")
    act = _attr(lm_config, "hidden_act")
    if isinstance(act, str) and act not in ("silu", "swish"):
        features.add(f"activation_{act}")
    n_mtp = _int_attr(lm_config, "num_nextn_predict_layers", "num_mtp_layers") or 0
    hidden = emb.shape[1]
    mtp = n_mtp * (layers[-1].params + 3 * hidden + 2 * hidden * hidden) if layers else 0
    return ModelSpec(
        model_type=top.str("model_type"), family=f"transformers:{type(model).__name__}",
        source=source, hidden_size=hidden, vocab_size=emb.shape[0],
        max_context=_int_attr(lm_config, "max_position_embeddings", "max_seq_len") or 0,
        tie_word_embeddings=tied, weight_dtype=dtype, quantization=parse_quantization(quant),
        layers=tuple(layers), top_level=tuple(top_level),
        vision_params=_vision_params(meta), mtp_params=mtp, features=frozenset(features),
    )  # fmt: skip


def parameter_count(model: Any) -> int:
    """Sum of numel over the module's unique parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def _int_attr(obj: Any, *names: str) -> int | None:
    for name in names:
        value = _attr(obj, name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _attr(obj: Any, name: str) -> Any:
    """getattr that also treats a heterogeneous config's refusal to give a global value of a
    per-layer field (transformers' AmbiguousGlobalPerLayerAttributeError) as absent."""
    try:
        return getattr(obj, name, None)
    except Exception:  # that error class is not an AttributeError
        return None


def _layer_config(cfg: Any, i: int) -> Any:
    """The config that holds layer i's fields: its entry of `per_layer_config` where the config
    is heterogeneous (fields vary by layer), else the config itself."""
    per_layer = _attr(cfg, "per_layer_config")
    if isinstance(per_layer, (list, tuple)) and i < len(per_layer):
        return per_layer[i]
    if isinstance(per_layer, dict) and i in per_layer:
        return per_layer[i]
    return cfg


def _decoder_layers(model: Any) -> tuple[str, Any]:
    """(path, ModuleList) of the decoder layers: the ModuleList holding most parameters."""
    import torch

    best, best_n = None, -1
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        if name.rsplit(".", 1)[-1] == "experts":
            continue
        n = sum(p.numel() for p in module.parameters())
        if n > best_n:
            best, best_n = (name, module), n
    if best is None:
        raise InputError(f"{type(model).__name__}: no list of decoder layers in the module tree")
    return best


def _owned(module: Any, prefix: str = "") -> Iterator[tuple[str, Any, str, Any]]:
    """(path, owner module, leaf name, parameter) for every parameter under `module`."""
    for mod_path, mod in module.named_modules(prefix=prefix):
        for leaf, p in mod._parameters.items():
            if p is not None:
                yield (f"{mod_path}.{leaf}" if mod_path else leaf), mod, leaf, p


def _is_norm(module: Any) -> bool:
    return "Norm" in type(module).__name__


def _is_expert_container(name: str, module: Any) -> bool:
    cls = type(module).__name__
    return name == "experts" or (cls.endswith("Experts") and "Shared" not in cls)


def _containers(module: Any, prefix: str) -> list[tuple[str, Any]]:
    """Outermost expert containers under `module` (paths relative to the layer)."""
    found: list[tuple[str, Any]] = []
    for path, sub in module.named_modules(prefix=prefix):
        leaf = path.rsplit(".", 1)[-1]
        if any(path.startswith(f"{c}.") for c, _ in found):
            continue
        if "shared" in leaf:
            continue
        if _is_expert_container(leaf, sub) and any(True for _ in sub.parameters()):
            found.append((path, sub))
    return found


def _child_kind(name: str, child: Any) -> str:
    if all(_is_norm(m) for m in child.modules() if m._parameters) or _is_norm(child):
        return "norm"
    cls = type(child).__name__
    if name in MIXER_NAMES and (_MIXER_CLASS.search(cls) or not _FFN_CLASS.search(cls)):
        return "mixer"
    if _containers(child, name):
        return "moe"
    if name in FFN_NAMES or _FFN_CLASS.search(type(child).__name__):
        return "shared_mlp" if "shared" in name else "mlp"
    return "other"


def _matmul(owner: Any, leaf: str, p: Any) -> bool:
    import torch

    if isinstance(owner, (torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)):
        return False
    return p.dim() == 2 and "bias" not in leaf and leaf not in _NOT_MATMUL


def _layer(i: int, prefix: str, layer: Any, cfg: Any, hidden: int, seen: set[int],
           approx: set[str], label: str) -> LayerSpec:  # fmt: skip
    tensors: list[TensorSpec] = []
    mixers: list[tuple[str, Any]] = []
    moe_blocks: list[Any] = []
    experts_total = 0
    num_experts = 0
    for name, child in layer.named_children():
        kind = _child_kind(name, child)
        path = f"{prefix}.{name}"
        if kind == "mixer":
            mixers.append((name, child))
        if kind == "moe":
            moe_blocks.append(child)
        containers = _containers(child, path)
        for _, c in containers:
            n = _experts_in(c)
            num_experts = max(num_experts, n)
        tensors += _child_tensors(kind, path, child, containers, seen)
        if kind == "moe":
            tensors += _router_buffers(path, child, containers)
    for leaf, p in layer._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            tensors.append(_tensor(f"{prefix}.{leaf}", p, "other", matmul=False))
    experts_total = sum(t.numel for t in tensors if t.role == "experts")
    layer_type = _layer_type(cfg, i)
    cfg = _layer_config(cfg, i)
    attention = _attention_of(mixers, cfg, layer_type, hidden, approx)
    if experts_total:
        blocks = moe_blocks or [m for _, m in mixers]
        ffn = _moe_ffn(tensors, blocks, cfg, i, num_experts, hidden, label)
    else:
        ffn = FfnSpec(kind="dense", activation=_act(cfg), intermediate_size=_width(
            [t for t in tensors if t.role == "mlp"], hidden))  # fmt: skip
    return LayerSpec(index=i, attention=attention, ffn=ffn, tensors=tuple(tensors))


def _experts_in(container: Any) -> int:
    import torch

    if isinstance(container, torch.nn.ModuleList):
        return len(container)
    n = _int_attr(container, "num_experts", "num_routed_experts", "n_routed_experts")
    if n:
        return n
    leading = Counter(p.shape[0] for p in container.parameters() if p.dim() >= 2)
    return leading.most_common(1)[0][0] if leading else 0


def _tensor(name: str, p: Any, role: str, *, matmul: bool, copies: int = 1,
            shape: tuple[int, ...] | None = None) -> TensorSpec:  # fmt: skip
    quantizable = matmul and role not in ("norm", "router", "embedding")
    return TensorSpec(
        name=name, shape=shape or tuple(p.shape), role=role, copies=copies, matmul=matmul,
        quantizable=quantizable,
    )  # fmt: skip


def _child_tensors(kind: str, path: str, child: Any, containers: list, seen: set[int]) -> list:
    import torch

    base = {"mixer": "attention", "mlp": "mlp", "shared_mlp": "shared", "norm": "norm",
            "other": "other", "moe": "router"}[kind]  # fmt: skip
    out: list[TensorSpec] = []
    grouped: dict[str, list[tuple[int, str, Any, Any, str]]] = {}
    for name, owner, leaf, p in _owned(child, path):
        if id(p) in seen:
            continue
        seen.add(id(p))
        container = next(((c, m) for c, m in containers if name.startswith(f"{c}.")), None)
        if _is_norm(owner) and p.dim() == 1:
            out.append(_tensor(name, p, "norm", matmul=False))
            continue
        if container is not None:
            c_path, c_mod = container
            rest = name[len(c_path) + 1 :].split(".")
            if any(s in ("router", "gate", "gating") for s in rest[:-1]):
                out.append(_tensor(name, p, "router", matmul=_matmul(owner, leaf, p)))
                continue
            if isinstance(c_mod, torch.nn.ModuleList) and rest[0].isdigit():
                grouped.setdefault(".".join(rest[1:]), []).append(
                    (int(rest[0]), name, owner, p, leaf)
                )
                continue
            if p.dim() >= 2:
                per_copy = tuple(p.shape[1:])
                out.append(_tensor(name, p, "experts", matmul=len(per_copy) == 2,
                                   copies=p.shape[0], shape=per_copy))  # fmt: skip
                continue
            out.append(_tensor(name, p, "attention" if kind == "mixer" else "shared",
                               matmul=False))  # fmt: skip
            continue
        role = base
        if kind == "moe":
            segments = name[len(path) + 1 :].split(".")
            if any("shared" in s for s in segments):
                role = "shared"
            elif any("latent" in s for s in segments):
                role = "latent"
        out.append(_tensor(name, p, role, matmul=_matmul(owner, leaf, p)))
    for entries in grouped.values():
        shapes = {tuple(p.shape) for _, _, _, p, _ in entries}
        if len(shapes) == 1:
            first = min(entries, key=lambda e: e[0])
            _, name, owner, p, leaf = first
            out.append(_tensor(name, p, "experts", matmul=_matmul(owner, leaf, p),
                               copies=len(entries)))  # fmt: skip
        else:
            for _, name, owner, p, leaf in sorted(entries, key=lambda e: e[0]):
                out.append(_tensor(name, p, "experts", matmul=_matmul(owner, leaf, p)))
    return out


def _router_buffers(path: str, block: Any, containers: list) -> list[TensorSpec]:
    """Persistent buffers of the MoE block outside its experts (a score-correction bias)."""
    out = []
    for mod_path, mod in block.named_modules(prefix=path):
        if any(mod_path == c or mod_path.startswith(f"{c}.") for c, _ in containers):
            continue
        for leaf, b in mod._buffers.items():
            if b is None or leaf in mod._non_persistent_buffers_set:
                continue
            out.append(
                TensorSpec(
                    name=f"{mod_path}.{leaf}",
                    shape=tuple(b.shape),
                    role="router",
                    matmul=False,
                    quantizable=False,
                    buffer=True,
                )
            )
    return out


def _act(cfg: Any) -> str:
    act = _attr(cfg, "hidden_act")
    return act if isinstance(act, str) else "silu"


def _width(tensors: list[TensorSpec], hidden: int) -> int:
    """Intermediate width of an MLP from its matmul shapes: the down projection's input width
    (`[out, in]`), else the widest dimension that is not the model width."""
    mats = [t for t in tensors if t.matmul and len(t.shape) == 2]
    for t in mats:
        leaf = t.name.rsplit(".", 2)[-2] if t.name.endswith(".weight") else t.name.rsplit(".")[-1]
        if any(k in leaf for k in ("down", "w2", "output", "fc2")) and 1 not in t.shape:
            return t.shape[1]
    dims = [d for t in mats for d in t.shape if d != hidden and d != 1]
    return min(dims) if dims else 0


def _top_k(blocks: list[Any], cfg: Any, index: int) -> int | None:
    for block in blocks:
        for module in block.modules():
            k = _int_attr(module, *_TOPK_ATTRS)
            if k:
                return k
    for name in _TOPK_ATTRS:
        value = _attr(cfg, name)
        if isinstance(value, list) and value:
            value = value[min(index, len(value) - 1)]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    ffn = _attr(cfg, "ffn_config")
    return _int_attr(ffn, "moe_top_k") if ffn is not None else None


def _moe_ffn(tensors: list[TensorSpec], blocks: list[Any], cfg: Any, i: int, num_experts: int,
             hidden: int, label: str) -> FfnSpec:  # fmt: skip
    top_k = _top_k(blocks, cfg, i)
    if not top_k:
        raise InputError(
            f"{label}: field 'num_experts_per_tok' is missing (layer {i} of "
            f"{type(cfg).__name__} has {num_experts} routed experts and no top-k in "
            f"{' / '.join(_TOPK_ATTRS[1:])})"
        )
    experts = [t for t in tensors if t.role == "experts"]
    shared = [t for t in tensors if t.role == "shared"]
    router = [t for t in tensors if t.role == "router"]
    expert_hidden = hidden
    down = [t for t in experts if "down" in t.name or "w2" in t.name or "output" in t.name]
    if down and len(down[0].shape) == 2:
        expert_hidden = down[0].shape[0]
    n_shared = _int_attr(cfg, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
    sigmoid = _attr(cfg, "scoring_func") == "sigmoid" or any(t.buffer for t in router)
    return FfnSpec(
        kind="moe", activation=_act(cfg), num_experts=num_experts, top_k=min(top_k, num_experts),
        expert_intermediate_size=_width(experts, expert_hidden), expert_hidden_size=expert_hidden,
        num_shared_experts=(n_shared or 1) if shared else 0,
        shared_intermediate_size=_width(shared, hidden) if shared else 0,
        router="sigmoid" if sigmoid else "softmax",
        n_group=_int_attr(cfg, "n_group", "num_expert_group") or 1,
        topk_group=_int_attr(cfg, "topk_group") or 1,
        norm_topk_prob=bool(_attr(cfg, "norm_topk_prob")),
        correction_bias=any(t.buffer for t in router),
        routed_scaling_factor=float(_attr(cfg, "routed_scaling_factor") or 1.0),
        shared_expert_gate=any("shared_expert_gate" in t.name for t in shared),
    )  # fmt: skip


def _top_level(model: Any, emb: Any, lm_head: Any, seen: set[int]) -> list[TensorSpec]:
    out = []
    for name, owner, leaf, p in _owned(model):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb:
            out.append(TensorSpec(name=name, shape=tuple(p.shape), role="embedding",
                                  matmul=False, quantizable=False))  # fmt: skip
        elif p is lm_head:
            out.append(_tensor(name, p, "lm_head", matmul=True))
        elif _is_norm(owner) and p.dim() == 1:
            out.append(_tensor(name, p, "norm", matmul=False))
        else:
            out.append(_tensor(name, p, "other", matmul=_matmul(owner, leaf, p)))
    return out


# ----- attention ------------------------------------------------------------------------------
def _layer_type(cfg: Any, i: int) -> str:
    types = _attr(cfg, "layer_types")
    if isinstance(types, (list, tuple)) and i < len(types) and isinstance(types[i], str):
        return types[i]
    return ""


def _conv(module: Any) -> tuple[int, int]:
    """(kernel, channels) of the mixer's depthwise short convolution, (0, 0) without one."""
    for name, sub in module.named_modules():
        w = sub._parameters.get("weight") if name.endswith("conv1d") else None
        if w is not None and w.dim() == 3 and w.shape[1] == 1:
            return int(w.shape[2]), int(w.shape[0])
    return 0, 0


def _linear_out(module: Any, *prefixes: str) -> int:
    """Summed output width of the projections whose leaf name starts with a prefix: a Linear's
    out_features, or that of the first Linear inside a wrapper module (Inkling's k_proj.linear)."""
    total, matched = 0, []
    for name, sub in module.named_modules():
        if any(name.startswith(f"{m}.") for m in matched):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if not any(leaf.startswith(p) for p in prefixes):
            continue
        inner = next((m for m in sub.modules() if hasattr(m, "out_features")), None)
        if inner is not None:
            matched.append(name)
            total += inner.out_features
    return total


def _attention_of(mixers: list, cfg: Any, layer_type: str, hidden: int,
                  approx: set[str]) -> AttentionSpec:  # fmt: skip
    import torch

    if not mixers:
        return AttentionSpec(kind="none", num_heads=0, num_kv_heads=0, head_dim=0, v_head_dim=0)
    _, module = mixers[0]
    count = 1
    if isinstance(module, torch.nn.ModuleList):
        count, module = len(module), module[0]
    spec = _mixer_spec(module, cfg, layer_type, hidden, approx)
    return AttentionSpec(**{**spec.__dict__, "count": count}) if count != 1 else spec


def _mixer_spec(m: Any, cfg: Any, layer_type: str, hidden: int,
                approx: set[str]) -> AttentionSpec:  # fmt: skip
    cls = type(m).__name__
    kernel, channels = _conv(m)
    conv = {"conv_kernel": kernel, "conv_channels": channels}
    heads_cfg = _int_attr(cfg, "num_attention_heads") or 1
    if _int_attr(m, "ssm_state_size"):
        d_state = m.ssm_state_size
        heads = _int_attr(m, "num_heads")
        if heads:
            return AttentionSpec(kind="mamba", num_heads=heads, num_kv_heads=heads,
                                 head_dim=d_state, v_head_dim=m.head_dim, **conv)  # fmt: skip
        inner = _int_attr(m, "intermediate_size") or hidden
        return AttentionSpec(kind="mamba", num_heads=1, num_kv_heads=1, head_dim=d_state,
                             v_head_dim=inner, **conv)  # fmt: skip
    if _int_attr(m, "num_v_heads") and _int_attr(m, "head_k_dim"):
        return AttentionSpec(kind="deltanet", num_heads=m.num_v_heads,
                             num_kv_heads=_int_attr(m, "num_k_heads") or m.num_v_heads,
                             head_dim=m.head_k_dim, v_head_dim=m.head_v_dim, **conv)  # fmt: skip
    if "Lightning" in cls:
        heads = _int_attr(m, "num_attention_heads", "num_heads") or heads_cfg
        hd = _int_attr(m, "head_dim") or hidden // heads
        return AttentionSpec(kind="lightning", num_heads=heads, num_kv_heads=heads, head_dim=hd,
                             v_head_dim=hd)  # fmt: skip
    if "Delta" in cls or "KDA" in cls:
        heads = _int_attr(m, "num_heads") or heads_cfg
        hd = _int_attr(m, "head_dim") or hidden // heads
        return AttentionSpec(kind="linear", num_heads=heads, num_kv_heads=heads, head_dim=hd,
                             v_head_dim=hd, **conv)  # fmt: skip
    window = _window(m, cfg, layer_type)
    names = {n.rsplit(".", 1)[-1] for n, _ in m.named_modules()}
    sinks = "sinks" in m._parameters
    if _int_attr(m, "kv_lora_rank") and "kv_a_proj_with_mqa" in names:
        rope = _int_attr(m, "qk_rope_head_dim") or 0
        nope = _int_attr(m, "qk_nope_head_dim") or 0
        heads = _int_attr(m, "num_heads") or heads_cfg
        indexer = _indexer_dim(m)
        return AttentionSpec(
            kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope,
            v_head_dim=_int_attr(m, "v_head_dim") or nope, window=window,
            q_lora_rank=_int_attr(m, "q_lora_rank"), kv_lora_rank=m.kv_lora_rank,
            qk_rope_head_dim=rope, qk_nope_head_dim=nope, sinks=sinks,
            output_gate="g_proj" in names or "gate_proj" in names, indexer_dim=indexer,
        )  # fmt: skip
    if "Attention" not in cls and "Attn" not in cls:
        approx.add(f"mixer_as_attention:{cls}")
    heads = _int_attr(m, "num_heads", "num_attention_heads") or heads_cfg
    hd = _int_attr(m, "head_dim") or _int_attr(cfg, "head_dim") or hidden // heads
    k_out, v_out = _linear_out(m, "k_proj"), _linear_out(m, "v_proj")
    if not (k_out and v_out):
        fused_kv = _linear_out(m, "kv_proj")
        fused_qkv = _linear_out(m, "qkv_proj", "Wqkv", "query_key_value", "c_attn")
        if fused_kv:
            k_out, v_out = fused_kv, 0
        elif fused_qkv > heads * hd:
            k_out = v_out = (fused_qkv - heads * hd) // 2
        else:
            kvh = _int_attr(m, "num_key_value_heads") or _int_attr(cfg, "num_key_value_heads")
            k_out = v_out = (kvh or heads) * hd
            approx.add(f"kv_from_config:{cls}")
    kvh, hd_k, hd_v = _kv_layout(k_out, v_out, hd)
    kind = {"sliding": "sliding", "chunked": "chunked"}.get(_window_kind(layer_type), "gqa")
    if kind == "gqa" and window:
        kind = "sliding"
    if "compress" in layer_type:
        approx.add(f"compressed_kv_as_dense:{cls}")
    return AttentionSpec(
        kind=kind, num_heads=heads, num_kv_heads=kvh, head_dim=hd_k, v_head_dim=hd_v,
        window=window if kind != "gqa" else None, sinks=sinks,
        qk_norm="q_norm" in names and "k_norm" in names,
        output_gate="g_proj" in names or "gate_proj" in names,
        indexer_dim=_indexer_dim(m),
    )  # fmt: skip


def _indexer_dim(m: Any) -> int:
    """Key width a sparse-attention indexer caches per token (its `wk` projection), 0 if none."""
    for name, sub in m.named_modules():
        if name.rsplit(".", 1)[-1] == "indexer":
            return _linear_out(sub, "wk")
    return 0


def _kv_layout(k_out: int, v_out: int, head_dim: int) -> tuple[int, int, int]:
    """(kv heads, key head dim, value head dim) with heads x (k + v) = k_out + v_out exactly."""
    if head_dim and k_out % head_dim == 0:
        kvh = k_out // head_dim
        if v_out % kvh == 0:
            return kvh, head_dim, v_out // kvh
    return 1, k_out, v_out


def _window_kind(layer_type: str) -> str:
    if "sliding" in layer_type:
        return "sliding"
    if "chunked" in layer_type:
        return "chunked"
    return ""


def _window(m: Any, cfg: Any, layer_type: str) -> int | None:
    own = _int_attr(m, "sliding_window")
    kind = _window_kind(layer_type)
    if kind == "chunked":
        return _int_attr(cfg, "attention_chunk_size") or own
    if kind == "sliding":
        return own or _int_attr(cfg, "sliding_window")
    if layer_type:  # a layer type that is not windowed: full attention, whatever the module says
        return None
    return own


# ----- multimodal ------------------------------------------------------------------------------
def _vision_params(meta: MetaModel) -> int:
    """Parameters of the towers beside the language model (vision, audio), counted on the
    multimodal class transformers maps the config to; 0 for a text-only config."""
    import torch
    from transformers.models.auto import modeling_auto

    config = meta.config
    subs = [k for k in getattr(config, "sub_configs", {}) or {} if k != "text_config"]
    if not any(("vision" in k or "audio" in k) for k in subs):
        return 0
    model_type = getattr(config, "model_type", "")
    for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES"):  # fmt: skip
        names = getattr(modeling_auto, mapping, {})
        cls_name = names.get(model_type)
        if not cls_name:
            continue
        import transformers

        cls = getattr(transformers, cls_name, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                full = cls._from_config(config, dtype=torch.bfloat16)
        except Exception:  # an unbuildable tower only loses this one figure
            return 0
        return max(0, parameter_count(full) - parameter_count(meta.model))
    return 0


# ----- cross-check against the hand-written families -------------------------------------------
CROSS_CHECKED = ("total_params", "expert_params", "embedding_params", "active_params",
                 "kv_bytes_per_token", "state_bytes_per_sequence")  # fmt: skip


def cross_check(native: ModelSpec, meta: ModelSpec) -> dict[str, tuple[int, int]]:
    """Figures on which a hand-written family's spec and the meta-model spec of the same config
    disagree: name -> (native, meta); empty when they agree."""
    out = {}
    for name in CROSS_CHECKED:
        a, b = getattr(native, name), getattr(meta, name)
        a = a() if callable(a) else a
        b = b() if callable(b) else b
        if a != b:
            out[name] = (a, b)
    return out
