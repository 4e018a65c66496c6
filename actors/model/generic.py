"""A pipeline stage of a model whose layers are not implemented natively: transformers' own
decoder-layer modules, with attention through the paged KV cache (issue 37, item 4).

vLLM's Transformers backend runs a model the day transformers knows it by handing its attention
to the engine; this does the same for one stage of a sharded model:

Step 1: transformers' model class is built on the meta device (no memory); the stage keeps its
        decoder layers [start, stop), the embedding on the first stage, the final norm and the
        head on the last, and drops the rest.
Step 2: only the stage's tensors are read from the checkpoint, through transformers' own key
        conversions (per-expert files into fused expert tensors, renamings), onto the device.
Step 3: every attention module calls `paged_attention` (registered as transformers attention
        implementation `moe_paged`): the step's new K/V go into the paged cache at their slots
        and each sequence attends over its cached context (`paged_attend`, the native layers'
        own path), so continuous batching, prefix caching and KV tiers work as for the native
        families. A decode step's `DecodeView` (CUDA fast decode) is served too. Keys and
        values of different sizes (MLA expanded per head by transformers, deepseek_v2 and its
        kin) are cached zero-padded to the larger (`kv_head_dim`): scores and outputs unchanged,
        the cache larger than the latent (moectl adapt states by how much).

Step 4 (expert parallelism): every fused experts module runs through transformers' experts
        interface as `moe_ep` (registered here): an EP rank keeps its experts' rows of
        gate_up_proj / down_proj, and each (token, k) row goes to its expert's rank and back
        through the native `ExpertParallel` dispatch and combine.

What is refused, in one line naming the layer's module path and class: an attention kind other
than full or sliding-window softmax attention, linear attention that keeps its state through
transformers' cache interface and DeepSeek Sparse Attention (compressed attention, a per-layer
rotary), attention sinks, and tensor parallelism (transformers' layers run whole). Routers,
norms and shared experts run as transformers wrote them.

Step 5 (linear attention, hybrids such as qwen3_next): a `linear_attention` layer keeps a
        state per sequence, not KV blocks. The scheduler gives each running sequence a state
        slot; the layer runs transformers' module over a cache view of its sequences' conv and
        recurrent rows (actors/model/linear_state.py), with our gated delta rule in place of
        its own (actors/kernels/delta_rule.py), decodes batched and each prompt chunk on its
        own; prefixes are cached with state snapshots (actors/engine/snapshots.py).

Step 6 (DeepSeek Sparse Attention: deepseek_v32, glm_moe_dsa, axk2): an `indexed_attention`
        layer's indexer keeps its keys beside the paged KV and picks each query's top-k tokens;
        `paged_attention` attends to those only (actors/model/sparse_index.py).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from actors.model.arch import ArchConfig, RopeConfig
from cluster.errors import InputError

ATTENTION = "moe_paged"
"""The transformers attention implementation this module registers."""

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` entries the paged cache serves."""
LINEAR_LAYER_TYPE = "linear_attention"
"""The `config.layer_types` entry of a layer with a state per sequence (actors/model/linear_state.py)."""
INDEXED_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")
"""`config.layer_types` entries of a DeepSeek Sparse Attention layer (transformers 5.2x, 5.1x;
actors/model/sparse_index.py)."""

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def generic_arch(cfg: dict[str, Any], source: str) -> ArchConfig:
    """The ArchConfig the runners need (KV layout, sizes) of a model_type transformers knows and
    the native layers do not; InputError naming `source` when transformers does not know it."""
    import transformers

    model_type = cfg.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise InputError(
            f"{source}: model_type={model_type!r} is known neither natively nor to the "
            f"installed transformers {transformers.__version__}"
        )
    config = hf_config(cfg, source)
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if getattr(text, "kv_lora_rank", None):  # MLA: the latent expands to keys and values per head
        kv_heads = heads
    head_dim = kv_head_dim(text)
    types = tuple(getattr(text, "layer_types", None) or ())
    windows = {getattr(text, "sliding_window", None) for t in types if t == "sliding_attention"}
    experts = int(
        getattr(text, "num_experts", None)
        or getattr(text, "num_local_experts", None)
        or getattr(text, "n_routed_experts", None)
        or 0
    )
    return ArchConfig(
        family=str(model_type),
        generic=True,
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
        rope=RopeConfig(dim=head_dim, theta=10000.0, kind="default"),
        sliding_window=next(iter(windows)) if len(windows) == 1 and None not in windows else None,
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        moe_intermediate_size=int(getattr(text, "moe_intermediate_size", 0) or 0),
        num_experts=experts,
        top_k=int(getattr(text, "num_experts_per_tok", 0) or 0),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR_LAYER_TYPE),
        indexed_layers=tuple(i for i, t in enumerate(types) if t in INDEXED_LAYER_TYPES),
    )


def head_dims(text: Any) -> tuple[int, int]:
    """(key, value) head sizes of a text config: MLA's qk_nope + qk_rope against v_head_dim,
    else head_dim (or hidden / heads) for both unless v_head_dim says otherwise."""
    heads = int(text.num_attention_heads)
    plain = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    nope, rope = getattr(text, "qk_nope_head_dim", None), getattr(text, "qk_rope_head_dim", None)
    key = int(nope) + int(rope) if nope is not None and rope is not None else plain
    return key, int(getattr(text, "v_head_dim", None) or key)


def kv_head_dim(text: Any) -> int:
    """The head size the paged cache holds keys and values at: the larger of the two."""
    return max(head_dims(text))


def hf_config(cfg: dict[str, Any], source: str) -> Any:
    """transformers' config object of `cfg` (a config.json dict)."""
    import transformers

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    except Exception as exc:  # its validators raise their own classes (strict dataclasses)
        message = " ".join(str(exc).split())
        raise InputError(
            f"{source}: transformers {transformers.__version__} rejects this config: "
            f"{type(exc).__name__}: {message}"
        ) from None


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the step's paged context (`kwargs["paged"]`):
    query [1, H, T, D], key and value [1, KV, T, D], the step's new tokens (its sequences one
    after another, after rotary and norms) -> ([1, T, H, D], None). The mask is not read: the
    context's query and context lengths make it (causal, `sliding_window` when given)."""
    from actors.kernels.decode_step import DecodeView
    from actors.model.layers.attention import paged_attend

    paged = kwargs.get("paged")
    if paged is None:
        raise RuntimeError("moe_paged attention runs inside a GenericStage step (no paged context)")
    view = paged.layer(module.layer_idx)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    dv = v.shape[-1]
    if q.shape[-1] != dv:  # keys and values of different sizes (MLA expanded to heads): the
        d = max(q.shape[-1], dv)  # cache holds both zero-padded to the larger (kv_head_dim)
        q, k, v = (nn.functional.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))
    view.write(k, v)
    indices = kwargs.get("indices")
    if indices is not None:  # DeepSeek Sparse Attention: the indexer's top-k tokens only
        from actors.model.sparse_index import sparse_attend

        return sparse_attend(q.contiguous(), view, indices[0], scale=scale)[None, ..., :dv], None
    if isinstance(view, DecodeView):
        return view.gqa(q.contiguous(), scale)[None, ..., :dv], None
    rep = q.shape[1] // k.shape[1]

    def expand(ck, cv):
        return ck.repeat_interleave(rep, dim=1), cv.repeat_interleave(rep, dim=1)

    out = paged_attend(
        q.contiguous(), view, expand, scale=scale, window=kwargs.get("sliding_window"),
        written=(k, v), grouped=True,
    )  # fmt: skip
    return out[None, ..., :dv], None


EXPERTS = "moe_ep"
"""The transformers experts implementation this module registers (expert parallelism)."""


def ep_experts(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights
) -> torch.Tensor:
    """transformers' experts interface under expert parallelism: hidden_states [T, H], top_k
    index / weights [T, K] (global experts) -> [T, H]. The (token, k) rows go to the ranks
    holding their experts (`ExpertParallel.dispatch`), run there through this rank's slices of
    the module's fused weights (gate_up_proj [E_local, 2I, H], down_proj [E_local, H, I]) and
    come back weighted and summed (`combine`)."""
    ep, local = module._moe_ep, module._moe_local
    recv_x, recv_ids, handle = ep.dispatch(hidden_states, top_k_index, top_k_weights)
    y = torch.empty_like(recv_x)
    slots = local.to(recv_ids.device)[recv_ids]
    for e in torch.unique(slots).tolist():
        rows = (slots == e).nonzero().squeeze(1)
        h = module._apply_gate(nn.functional.linear(recv_x[rows], module.gate_up_proj[e]))
        y[rows] = nn.functional.linear(h, module.down_proj[e]).to(y.dtype)
    return ep.combine(y, handle)


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module with fused 3D weights, dispatched through its experts
    interface (`use_experts_implementation`)."""
    return hasattr(type(module).forward, "__wrapped__") and hasattr(module, "gate_up_proj")


def refuse_tp(arch: ArchConfig, tp: int, where: str) -> None:
    """InputError (naming `where` and the model type) for tensor parallelism of a model the
    generic path runs: its layers are transformers' own, whole."""
    if arch.generic and tp > 1:
        raise InputError(
            f"{where}: model_type={arch.family!r} runs through transformers' own layers (not "
            "natively), which split over pipeline stages and experts only: no tp"
        )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    AttentionInterface.register(ATTENTION, paged_attention)
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, ep_experts)


class GenericStage(nn.Module):
    """Layers [start, stop) of a transformers model, with StageModel's interface (`forward`,
    `first`, `last`, `arch`, `layer_range`); see the module docstring."""

    def __init__(
        self,
        arch: ArchConfig,
        config: Any,
        *,
        layer_range: tuple[int, int],
        first: bool,
        last: bool,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        start, stop = layer_range
        if not 0 <= start <= stop <= arch.num_layers:
            raise InputError(
                f"layer_range={layer_range} is outside the model's {arch.num_layers} layers"
            )
        self.arch, self.layer_range, self.first, self.last = arch, (start, stop), first, last
        self.config = config
        text = config.get_text_config()
        full, base = meta_model(config, layer_range)
        layers = base.layers
        self.embed_tokens = full.get_input_embeddings() if first else None
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(start, stop)})
        self.norm = base.norm if last else None
        self.lm_head = full.get_output_embeddings() if last else None
        rotary = type(base.rotary_emb) if hasattr(base, "rotary_emb") else None  # None: NoPE
        # What transformers' loader walks (it finds conversions by the model's classes and
        # parameters by full names): the same model, pruned to this stage's modules.
        for i in range(arch.num_layers):
            if str(i) not in self.layers:
                layers[i] = nn.Module()
        if not first:
            full.set_input_embeddings(nn.Module())
        base.norm = self.norm if last else nn.Module()
        full.set_output_embeddings(self.lm_head if last else nn.Module())
        if rotary is not None:
            base.rotary_emb = nn.Module()
        self._loader_view = [full]  # (a list: not a submodule of the stage)
        self._ep_blocks: list[nn.Module] = []
        """The MoE blocks whose experts `shard_experts` split (an idle rank's `empty_pass`)."""
        from actors.model.linear_state import StatePool, attach

        self.states = StatePool()
        """The linear-attention layers' states, one row per engine state slot."""
        linear = {i: linear_module(layers[i]) for i in arch.linear_layers if start <= i < stop}
        attach({i: m for i, m in linear.items() if m is not None}, self.states)
        from actors.model import sparse_index

        self.index_keys = sparse_index.IndexKeys()
        """The DSA indexers' keys, one row per KV slot (actors/model/sparse_index.py)."""
        indexed = {i: attention_module(layers[i]) for i in arch.indexed_layers if start <= i < stop}
        sparse_index.attach(indexed, self.index_keys)
        self._topk_passed = {
            i: "prev_topk_indices" in inspect.signature(type(layers[i]).forward).parameters
            for i in range(start, stop)
        }
        """Layers taking the previous layer's DSA indices (glm_moe_dsa's shared indexers)."""
        self.embedding_multiplier = float(getattr(text, "embedding_multiplier", 1.0) or 1.0)
        self.logits_scaling = float(getattr(text, "logits_scaling", 1.0) or 1.0)
        self.device_ = torch.device(device) if device is not None else torch.device("cpu")
        self.to_empty(device=self.device_)
        self.rotary_emb = None
        if rotary is not None:
            with torch.device(self.device_):
                self.rotary_emb = rotary(config=text)  # its buffers computed, not empty
        self.requires_grad_(False)
        self.eval()

    def stage_keys(self, names: Sequence[str]) -> list[str]:
        """The checkpoint tensors this stage reads: its layers', and the rest (embedding, norm,
        head) on the stages holding those (transformers' renamings map them)."""
        start, stop = self.layer_range
        out = []
        for name in names:
            m = _LAYER_KEY.search(name)
            if m is not None:
                if start <= int(m.group(1)) < stop:
                    out.append(name)
            elif self.first or self.last:
                out.append(name)
        return out

    def load(self, directory: Path, dtype: torch.dtype) -> list[str]:
        """Read the stage's tensors (Step 2); returns the names read."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        [model] = self._loader_view
        files = sorted(Path(directory).glob("*.safetensors"))
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
            state = {}
            for h in handles:
                for name in self.stage_keys(list(h.keys())):
                    state[name] = h.get_tensor(name)
            tied = self.last and self.arch.tie_word_embeddings
            config = LoadStateDictConfig(
                dtype=dtype, weight_mapping=get_model_conversion_mapping(model)
            )
            info, _ = convert_and_load_state_dict_in_model(model, state, config)
        missing = [k for k in info.missing_keys if not (tied and k.endswith("lm_head.weight"))]
        if missing or info.mismatched_keys or info.conversion_errors:
            raise InputError(
                f"{directory}: the checkpoint does not fill this stage: missing "
                f"{missing[:4]}, mismatched {list(info.mismatched_keys)[:4]}, errors "
                f"{list(info.conversion_errors)[:2]}"
            )
        if tied and self.embed_tokens is None:  # a last stage without the embedding it ties
            name = next((n for n in state if n.endswith("embed_tokens.weight")), None)
            if name is None:
                raise InputError(f"{directory}: tied embeddings, no embed_tokens.weight")
            self.lm_head.weight.copy_(state[name].to(dtype))
        elif tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.to(self.device_)
        self.requires_grad_(False)  # the loader's parameters are new ones
        return sorted(state)

    @torch.no_grad()
    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        *,
        capture: dict | None = None,
        paged: Any = None,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """StageModel.forward's contract: token ids [T] (first stage) or hidden states [T, H],
        positions [T]; logits [T or R, V] on the last stage, else hidden states [T, H]."""
        t = inputs.shape[0]
        if sum(seq_lens) != t or positions.shape != (t,):
            raise InputError(
                f"seq_lens sum {sum(seq_lens)} and positions {tuple(positions.shape)} must match {t} tokens"
            )
        if paged is None:  # whole sequences (validation): over a cache of their own
            paged = self._scratch_context(seq_lens, inputs.device)
        hooks = self._capture_hooks(capture) if capture is not None else []
        try:
            return self._forward(inputs, positions, paged, capture, logits_rows)
        finally:
            for h in hooks:
                h.remove()

    def _forward(self, inputs, positions, paged, capture, logits_rows) -> torch.Tensor:
        if self.first:
            x = self.embed_tokens(inputs)
            if capture is not None:  # the module's output, as transformers' capture takes it
                capture["model.embed_tokens"] = x
            x = x * self.embedding_multiplier
        else:
            x = inputs
        x = x[None]  # [1, T, H]: the step's tokens as one row, attention splits them per sequence
        pos = positions[None]
        # a multimodal rotary (mrope: temporal, height, width sections) over text: three equal rows
        mrope = getattr(self.rotary_emb, "mrope_section", None) is not None
        rotary = (
            self.rotary_emb(x, pos.expand(3, *pos.shape) if mrope else pos)
            if self.rotary_emb is not None
            else None  # no positions in any attention (NoPE: kimi_linear's MLA)
        )
        topk = None  # a layer's DSA indices, for a next one sharing them
        for name, layer in self.layers.items():
            shared = {"prev_topk_indices": topk} if self._topk_passed[int(name)] else {}
            out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rotary,
                        paged=paged, **shared)  # fmt: skip
            x = out[0] if isinstance(out, tuple) else out
            if shared:
                topk = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        x = x[0]
        if not self.last:
            return x
        if logits_rows is not None:
            x = x[logits_rows]
        x = self.norm(x)
        logits = self.lm_head(x)
        if capture is not None:
            capture["model.norm"] = x
            capture["lm_head"] = logits
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def _scratch_context(self, seq_lens: Sequence[int], device: torch.device) -> Any:
        """A PagedContext of fresh sequences over a KV cache made for this forward."""
        from actors.kv.cache import KVCache, KVLayout, PagedContext

        bs = 16
        layout = KVLayout.for_stage(
            self.arch, block_size=bs, layer_range=self.layer_range, dtype=self.dtype
        )
        tables, slots, at = [], [], 0
        for n in seq_lens:
            blocks = -(-n // bs)
            tables.append(tuple(range(at, at + blocks)))
            slots += range(at * bs, at * bs + n)
            at += blocks
        return PagedContext(
            cache=KVCache(layout, max(1, at), device),
            query_lens=tuple(seq_lens),
            context_lens=tuple(seq_lens),
            block_tables=tuple(tables),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            state_slots=tuple(range(len(seq_lens))) if self.arch.linear_layers else (),
        )

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _capture_hooks(self, capture: dict) -> list:
        """Forward hooks filling `capture` with the outputs transformers' reference capture
        takes of the same modules, under the same names (`actors.validate.reference`)."""
        from actors.validate.reference import LAYER_MODULES, capture_hooks

        modules = {}
        for i, layer in self.layers.items():
            for path in ("", *LAYER_MODULES):
                try:
                    module = layer.get_submodule(path) if path else layer
                except AttributeError:
                    continue
                modules[f"model.layers.{i}" + (f".{path}" if path else "")] = module
        return capture_hooks(modules, capture)

    def experts_modules(self) -> list[tuple[str, nn.Module]]:
        """(path, module) of every transformers experts module of the stage (fused 3D weights
        dispatched through its experts interface)."""
        return [
            (f"model.layers.{i}.{name}", m)
            for i, layer in self.layers.items()
            for name, m in layer.named_modules()
            if is_experts(m)
        ]

    def shard_experts(self, local_experts: Sequence[int], ep: Any) -> None:
        """Keep only `local_experts` of every experts module (their rows of the fused weights)
        and route the rest through `ep`: transformers' experts interface `moe_ep`. A module of
        another layout (biases, transposed or per-expert weights) is refused by path and class."""
        keep = torch.tensor(sorted(local_experts), dtype=torch.int64)
        found = self.experts_modules()
        if not found:
            raise InputError(
                f"model_type={self.arch.family!r}: no transformers experts module with fused "
                "gate_up_proj / down_proj to split over EP ranks"
            )
        for path, m in found:
            e = m.gate_up_proj.shape[0]
            if m.has_bias or m.is_transposed or not m.has_gate or m.down_proj.shape[0] != e:
                raise InputError(
                    f"{path}: {type(m).__name__} (biases, transposed or ungated experts) has "
                    "no expert-parallel path here"
                )
            local = torch.full((e,), -1, dtype=torch.int64)
            local[keep] = torch.arange(len(keep))
            m.gate_up_proj = nn.Parameter(m.gate_up_proj.data[keep].clone(), requires_grad=False)
            m.down_proj = nn.Parameter(m.down_proj.data[keep].clone(), requires_grad=False)
            m._moe_local = local
            m._moe_ep = ep.for_layer(int(path.split(".")[2]))
            m.config._experts_implementation = EXPERTS
        self._ep_blocks = [
            layer.mlp
            for layer in self.layers.values()
            if any(is_experts(m) for m in getattr(layer, "mlp", nn.Module()).modules())
        ]

    @torch.no_grad()
    def empty_pass(self, x: torch.Tensor) -> torch.Tensor:
        """An idle DP rank's micro-batch of no tokens under EP: each layer's MoE block takes part
        in its exchanges (other ranks' tokens may route to experts held here)."""
        for mlp in self._ep_blocks:
            out = mlp(x[None])
            x = (out[0] if isinstance(out, tuple) else out).reshape(0, x.shape[-1])
        return x

    # StageModel's other calls, with nothing to do here.
    def column_major_weights(self) -> None:
        pass

    def routing_counts(self) -> dict[int, torch.Tensor]:
        return {}

    def reset_routing_counts(self) -> None:
        pass


def meta_model(config: Any, layer_range: tuple[int, int] | None = None) -> tuple[Any, nn.Module]:
    """transformers' causal LM of `config` on the meta device and its decoder, checked for the
    generic path over `layer_range` (every layer when None): InputError naming what it cannot
    run (`refuse_unpaged`)."""
    import transformers

    text = config.get_text_config()
    config._attn_implementation = text._attn_implementation = ATTENTION
    _register()
    try:
        with torch.device("meta"):
            full = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers' own refusal of this config, in one line
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise InputError(
            f"transformers cannot build {type(config).__name__}'s model: "
            f"{type(exc).__name__} {first}"
        ) from None
    base = full.get_decoder()
    layers = getattr(base, "layers", None)
    n = int(text.num_hidden_layers)
    if not isinstance(layers, nn.ModuleList) or len(layers) != n:
        raise InputError(
            f"{type(full).__name__}: no decoder `layers` list of {n} modules "
            "(the generic path needs transformers' usual model.layers)"
        )
    refuse_unpaged(base, text, layer_range or (0, n))
    return full, base


def generic_check(cfg: dict[str, Any], source: str) -> ArchConfig:
    """Whether the generic path runs the model of config dict `cfg` (every layer): its
    ArchConfig, or InputError naming the module it cannot run. Nothing allocated."""
    arch = generic_arch(cfg, source)
    meta_model(hf_config(cfg, source))
    return arch


ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn")
"""Where transformers' decoder layers keep their attention module."""


def refuse_unpaged(base: nn.Module, text: Any, layer_range: tuple[int, int]) -> None:
    """InputError naming the first layer of the range whose attention the paged cache cannot
    serve, by module path and class: a layer type other than full or sliding softmax attention
    (linear attention without the cache interface, state-space mixers, sparse indexers), an
    attention module that does not dispatch through transformers' attention interface, one with
    attention sinks; also a base model whose rotary embedding differs per layer (one without
    any rotary module is NoPE and runs)."""
    nope = not any("rotary" in type(m).__name__.lower() for m in base.modules())
    if not nope and (
        not isinstance(getattr(base, "rotary_emb", None), nn.Module) or hasattr(base, "rotary_embs")
    ):
        raise InputError(
            f"{type(base).__name__}: no single rotary_emb (rotary settings per layer) has no "
            "generic path"
        )
    types = list(getattr(text, "layer_types", None) or ())
    for i in range(*layer_range):
        layer = base.layers[i]
        kind = types[i] if i < len(types) else "full_attention"
        if kind == LINEAR_LAYER_TYPE:
            if linear_module(layer) is None:
                raise InputError(
                    f"model.layers.{i}: {type(layer).__name__} ({kind}) has no module keeping "
                    "its state through transformers' cache interface (update_conv_state, "
                    "update_recurrent_state)"
                )
            continue
        name = attention_name(layer)
        if kind in INDEXED_LAYER_TYPES and name is not None:
            from actors.model.sparse_index import indexer_of, is_indexed

            attn = getattr(layer, name)
            path = f"model.layers.{i}.{name}: {type(attn).__name__}"
            if not (is_indexed(attn) and _dispatches(attn)):
                raise InputError(f"{path} ({kind}) has no DSA indexer we can run")
            if i == layer_range[0] and indexer_of(attn) is None:
                raise InputError(
                    f"{path} shares the indexer of the layer before it: a stage cannot start "
                    "there (its indices do not travel between stages)"
                )
            continue
        if kind not in ATTENTION_LAYER_TYPES or name is None:
            name, mod = next(
                ((n, m) for n, m in layer.named_children() if n not in ("mlp", "feed_forward")
                 and not n.endswith("norm")),
                ("", layer),
            )  # fmt: skip
            raise InputError(
                f"model.layers.{i}.{name}: {type(mod).__name__} ({kind}) has no paged path; "
                f"expected one of {', '.join(ATTENTION_LAYER_TYPES)}"
            )
        attn = getattr(layer, name)
        path = f"model.layers.{i}.{name}: {type(attn).__name__}"
        if not _dispatches(attn):
            raise InputError(f"{path} does not call transformers' attention interface")
        if "sinks" in dict(attn.named_parameters(recurse=False)):
            raise InputError(f"{path} has attention sinks, which the paged path does not add")


def attention_name(layer: nn.Module) -> str | None:
    """The name the decoder layer keeps its attention module by (ATTENTION_NAMES), None."""
    return next(
        (n for n in ATTENTION_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None
    )


def attention_module(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's attention module, None."""
    name = attention_name(layer)
    return None if name is None else getattr(layer, name)


def linear_module(layer: nn.Module) -> nn.Module | None:
    """The layer's linear-attention module that keeps its state through transformers' cache
    interface (`linear_state.keeps_cache_state`), None when it has none."""
    from actors.model.linear_state import keeps_cache_state

    return next((m for m in layer.children() if keeps_cache_state(m)), None)


def _dispatches(attn: nn.Module) -> bool:
    """Whether the module's forward hands q/k/v to transformers' attention interface (where
    `moe_paged` takes over) and knows its layer index."""
    try:
        source = inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source and isinstance(getattr(attn, "layer_idx", None), int)


def load_generic_stage(
    directory: Path | str,
    arch: ArchConfig,
    config: dict[str, Any],
    *,
    layer_range: tuple[int, int],
    dtype: torch.dtype,
    first: bool,
    last: bool,
    device: torch.device | str | None = None,
    local_experts: Sequence[int] | None = None,
    ep: Any = None,
) -> GenericStage:
    """`GenericStage` of the checkpoint at `directory`, its tensors read (`load_stage_model`
    for a family the native layers do not implement, under its default dtype); with
    `local_experts` and `ep` (an `actors.comm.ep.ExpertParallel`), only those experts kept, the
    others reached through it."""
    stage = GenericStage(
        arch,
        hf_config(config, str(Path(directory) / "config.json")),
        layer_range=layer_range,
        first=first,
        last=last,
        device=device,
    )
    stage.load(Path(directory), dtype)
    if local_experts is not None and ep is not None:
        stage.shard_experts(local_experts, ep)
    return stage
