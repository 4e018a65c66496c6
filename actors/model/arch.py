"""The hyperparameters the layers need, from a Hugging Face `config.json` (read by
`placement.model_spec.read_config`, its fields through `placement.config_fields.ConfigFields`).

Three families: `deepseek_v3` (also `kimi_k2`, the same architecture), `mixtral`, `qwen3_moe`.
Only what the forward pass uses is kept; `placement.ModelSpec` is the fuller description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.errors import InputError
from placement.config_fields import ConfigFields

FAMILIES = ("deepseek_v3", "mixtral", "qwen3_moe")
_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding, plain or YaRN (as DeepSeek-V3 uses it)."""

    dim: int
    """Rotated dimensions per head (MLA: qk_rope_head_dim)."""
    theta: float
    kind: str
    """'default' or 'yarn'."""
    interleave: bool = False
    """DeepSeek layout: rotated pairs are (x0, x1), (x2, x3) ... instead of the two halves."""
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    """Explicit multiplier on cos/sin; None derives it from factor and mscale (YaRN paper)."""
    truncate: bool = True


@dataclass(frozen=True, kw_only=True)
class ArchConfig:
    """One model's forward-pass hyperparameters. Build it with `ArchConfig.from_hf(config_dict)`."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """GQA head size (q, k and v). MLA: qk_nope_head_dim + qk_rope_head_dim (the q/k size)."""
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # MLA (deepseek_v3): q_lora_rank None means a plain q_proj.
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Feed-forward
    intermediate_size: int
    """Dense MLP width (dense layers)."""
    moe_intermediate_size: int
    """Width of one routed expert (and of one shared expert)."""
    num_experts: int
    top_k: int
    n_shared_experts: int = 0
    scoring: str = "softmax"
    """'softmax' (mixtral, qwen3_moe) or 'sigmoid' (deepseek_v3, with a correction bias)."""
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    dense_layers: tuple[int, ...] = ()
    """Layer indices with a dense MLP instead of a MoE block."""
    tie_word_embeddings: bool = False
    linear_layers: tuple[int, ...] = ()
    """Layers with a per-sequence state in place of KV (linear attention: gated DeltaNet, KDA):
    the engine gives each sequence a state slot and a prefix is cached with a state snapshot."""
    indexed_layers: tuple[int, ...] = ()
    """Layers whose attention a DeepSeek Sparse Attention indexer restricts to its top-k tokens
    (actors/model/sparse_index.py): they decode on the paged path; their index keys go to the
    tiers from an in-process runner only."""
    generic: bool = False
    """Layers run as transformers' own modules (`actors/model/generic.py`): `family` is then the
    config's model_type, and the fields past the sizes the runners read are informative."""

    @property
    def softmax_scale(self) -> float:
        """Attention logit multiplier: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for MLA+YaRN."""
        scale = self.head_dim**-0.5
        r = self.rope
        if self.mla and r.kind == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def moe_prefix(self) -> str:
        """The checkpoint name of a layer's MoE block ('block_sparse_moe' for Mixtral files)."""
        return "block_sparse_moe" if self.family == "mixtral" else "mlp"

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, source: str = "config.json") -> ArchConfig:
        """Read a Hugging Face config dict; InputError naming `source` and the field when it is bad."""
        model_type = cfg.get("model_type")
        family = _ALIASES.get(model_type, model_type)
        if family not in FAMILIES:
            raise InputError(
                f"{source}: model_type={model_type!r} is not supported; expected one of "
                f"{', '.join((*FAMILIES, *_ALIASES))}"
            )
        r = ConfigFields(dict(cfg), label=source)  # the one typed reader of config.json
        hidden = r.int("hidden_size", minimum=1)
        heads = r.int("num_attention_heads", minimum=1)
        num_layers = r.int("num_hidden_layers", minimum=1)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise InputError(f"{source}: hidden_act={act!r} is not supported; expected 'silu'")
        common: dict[str, Any] = {
            "family": family,
            "vocab_size": r.int("vocab_size", minimum=1),
            "hidden_size": hidden,
            "num_layers": num_layers,
            "num_heads": heads,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "intermediate_size": r.int("intermediate_size", minimum=1),
        }
        if family == "deepseek_v3":
            nope, rope_dim = (
                r.int("qk_nope_head_dim", minimum=1),
                r.int("qk_rope_head_dim", minimum=1),
            )
            n_experts = r.int("n_routed_experts", minimum=1)
            arch = cls(
                **common,
                num_kv_heads=heads,
                head_dim=nope + rope_dim,
                rope=_rope(
                    cfg, source, dim=rope_dim, interleave=bool(cfg.get("rope_interleave", True))
                ),
                mla=True,
                q_lora_rank=r.int("q_lora_rank", default=None, minimum=1),
                kv_lora_rank=r.int("kv_lora_rank", minimum=1),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope_dim,
                v_head_dim=r.int("v_head_dim", minimum=1),
                moe_intermediate_size=r.int("moe_intermediate_size", minimum=1),
                num_experts=n_experts,
                top_k=r.int("num_experts_per_tok", minimum=1),
                n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                scoring="sigmoid",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                n_group=int(cfg.get("n_group") or 1),
                topk_group=int(cfg.get("topk_group") or 1),
                dense_layers=tuple(
                    range(min(int(cfg.get("first_k_dense_replace") or 0), num_layers))
                ),
            )
        else:
            head_dim = cfg.get("head_dim") or hidden // heads
            if family == "mixtral":
                n_experts = r.int("num_local_experts", minimum=1)
                window = cfg.get("sliding_window")
                moe_width = r.int("intermediate_size", minimum=1)
                norm_topk, dense = True, ()
            else:
                n_experts = (
                    r.int("num_experts", minimum=1)
                    if "num_experts" in cfg
                    else r.int("num_local_experts", minimum=1)
                )
                window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
                moe_width = r.int("moe_intermediate_size", minimum=1)
                norm_topk = bool(cfg.get("norm_topk_prob", False))
                step = int(cfg.get("decoder_sparse_step") or 1)
                only = set(cfg.get("mlp_only_layers") or ())
                dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
            arch = cls(
                **common,
                num_kv_heads=r.int("num_key_value_heads", minimum=1),
                head_dim=int(head_dim),
                rope=_rope(cfg, source, dim=int(head_dim), interleave=False),
                qk_norm=family == "qwen3_moe",
                sliding_window=int(window) if window else None,
                moe_intermediate_size=moe_width,
                num_experts=n_experts,
                top_k=r.int("num_experts_per_tok", minimum=1),
                norm_topk_prob=norm_topk,
                dense_layers=dense,
            )
        arch._validate(source)
        return arch

    def _validate(self, source: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InputError(
                f"{source}: num_key_value_heads={self.num_kv_heads} does not divide "
                f"num_attention_heads={self.num_heads}"
            )
        if self.top_k > self.num_experts:
            raise InputError(
                f"{source}: num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts"
            )
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise InputError(
                f"{source}: n_group={self.n_group} does not divide {self.num_experts} routed experts"
            )
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise InputError(
                f"{source}: group-limited routing scores each group by its top-2 experts; "
                f"n_group={self.n_group} leaves {self.num_experts // self.n_group} per group"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise InputError(
                f"{source}: topk_group={self.topk_group} must be in 1..n_group={self.n_group}"
            )
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise InputError(
                f"{source}: num_experts_per_tok={self.top_k} exceeds the experts of "
                f"topk_group={self.topk_group} groups"
            )
        if self.rope.dim % 2:
            raise InputError(f"{source}: the rotary dimension {self.rope.dim} must be even")


def is_native(model_type: object) -> bool:
    """Whether the native layers implement `model_type` (else the generic path may run it)."""
    return _ALIASES.get(model_type, model_type) in FAMILIES  # type: ignore[arg-type]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope(cfg: Mapping[str, Any], source: str, *, dim: int, interleave: bool) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(dim=dim, theta=theta, kind="default", interleave=interleave)
    if kind != "yarn":
        raise InputError(
            f"{source}: rope_type={kind!r} is not supported; expected 'default' or 'yarn'"
        )
    original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    if not original:
        raise InputError(f"{source}: YaRN needs rope_parameters.original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = cfg["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        dim=dim,
        theta=theta,
        kind="yarn",
        interleave=interleave,
        factor=float(factor),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )
