"""Per-family readers: a config.json's fields -> the layers (attention, FFN, tensors) of a ModelSpec.

Each reader follows the family's reference implementation (Hugging Face transformers where it
knows the family, the vendor's modelling code otherwise) for which layers are MoE, which attention
each layer uses and which tensors exist. Shapes and counts are logical (unquantised).
Every field read also accepts the aliases transformers' config class maps onto it (its
`attribute_map`): transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from placement import blocks
from placement.config_fields import ConfigFields
from placement.layer_spec import AttentionSpec, FfnSpec, LayerSpec, TensorSpec


@dataclass(kw_only=True)
class Decoder:
    """What a family reader produces for the language model."""

    family: str
    hidden_size: int
    vocab_size: int
    layers: list[LayerSpec]
    max_context: int
    tie_word_embeddings: bool
    embed_name: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    norm_has_bias: bool = False
    mtp_params: int = 0
    features: set[str] = field(default_factory=set)
    """Operator-level facts used by the operator inventory (e.g. "rope_yarn", "qkv_clip")."""


@dataclass(kw_only=True)
class _Common:
    hidden: int
    vocab: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    activation: str


def _common(f: ConfigFields) -> _Common:
    hidden = f.int("hidden_size", minimum=1)
    heads = f.int("num_attention_heads", minimum=1)
    return _Common(
        hidden=hidden,
        vocab=f.int("vocab_size", minimum=1),
        num_layers=f.int("num_hidden_layers", minimum=1),
        heads=heads,
        kv_heads=f.int("num_key_value_heads", default=heads, minimum=1),
        head_dim=f.int("head_dim", default=hidden // heads, minimum=1),
        activation=f.str("hidden_act", default="silu"),
    )


def _layer_types(f: ConfigFields, n: int) -> tuple[str, ...] | None:
    types = f.str_list("layer_types", default=None)
    if types is not None and len(types) != n:
        raise f.error("layer_types", f"a list of {n} entries (num_hidden_layers)", list(types))
    return types


def _norms(prefix: str, hidden: int) -> list[TensorSpec]:
    return blocks.vector(f"{prefix}.input_layernorm.weight", hidden) + blocks.vector(
        f"{prefix}.post_attention_layernorm.weight", hidden
    )


def _features(f: ConfigFields) -> set[str]:
    feats = set()
    for name in ("rope_scaling", "rope_parameters"):
        section = f.section(name)
        if section is not None:
            kind = section.data.get("rope_type") or section.data.get("type")
            if kind == "yarn":
                feats.add("rope_yarn")
    return feats


def _moe(
    c: _Common, f: ConfigFields, prefix: str, *, experts: int, top_k: int, inter: int, router: str,
    shared: int = 0, n_shared: int = 0, correction: bool = False, groups: tuple[int, int] = (1, 1),
    norm_topk: bool = False, shared_gate: bool = False, shared_name: str = "shared_experts",
    router_name: str = "gate", router_bias: bool = False, scaling: float = 1.0,
) -> tuple[FfnSpec, list[TensorSpec]]:  # fmt: skip
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"at most the {experts} experts", top_k)
    t = blocks.router(f"{prefix}.{router_name}", c.hidden, experts, bias=router_bias,
                      correction_bias=correction)  # fmt: skip
    t += blocks.swiglu(f"{prefix}.experts.0", c.hidden, inter, "experts", copies=experts)
    if shared:
        t += blocks.swiglu(f"{prefix}.{shared_name}", c.hidden, shared, "shared")
    if shared_gate:
        t += blocks.linear(f"{prefix}.shared_expert_gate", 1, c.hidden, "shared", quantizable=False)
    spec = FfnSpec(
        kind="moe", activation=c.activation, num_experts=experts, top_k=top_k,
        expert_intermediate_size=inter, expert_hidden_size=c.hidden,
        num_shared_experts=n_shared or (1 if shared else 0), shared_intermediate_size=shared,
        router=router, n_group=groups[0], topk_group=groups[1], norm_topk_prob=norm_topk,
        correction_bias=correction, routed_scaling_factor=scaling, shared_expert_gate=shared_gate,
    )  # fmt: skip
    return spec, t


def _dense(c: _Common, prefix: str, inter: int, *, bias: bool = False) -> tuple[FfnSpec, list]:
    spec = FfnSpec(kind="dense", activation=c.activation, intermediate_size=inter)
    return spec, blocks.swiglu(prefix, c.hidden, inter, "mlp", bias=bias)


def _gqa_spec(c: _Common, kind: str, window: int | None, **kw) -> AttentionSpec:
    return AttentionSpec(
        kind=kind, num_heads=c.heads, num_kv_heads=c.kv_heads, head_dim=c.head_dim,
        v_head_dim=c.head_dim, window=window if kind in ("sliding", "chunked") else None, **kw,
    )  # fmt: skip


_KIND_OF_TYPE = {
    "full_attention": "gqa",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
}


def gqa_family(f: ConfigFields, family: str) -> Decoder:
    """llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, glm4_moe, gpt_oss."""
    c = _common(f)
    types = _layer_types(f, c.num_layers)
    window = f.int("sliding_window", default=None)
    use_sliding = f.bool("use_sliding_window", default=family in ("mistral", "mixtral", "llama"))
    max_window_layers = f.int("max_window_layers", default=0)
    qwen = family.startswith("qwen")
    bias = f.bool("attention_bias", default=family == "gpt_oss")
    qkv_bias = f.bool("qkv_bias", default=True) if family == "qwen2_moe" else bias
    if family == "qwen2":
        qkv_bias = True
    o_bias = bias and family in ("llama", "mistral", "qwen3", "qwen3_moe", "gpt_oss")
    qk_norm = family in ("qwen3", "qwen3_moe") or (
        family == "glm4_moe" and f.bool("use_qk_norm", default=False)
    )
    mlp_only = set(f.int_list("mlp_only_layers", default=()))
    sparse_step = f.int("decoder_sparse_step", default=1, minimum=1)
    first_dense = f.int("first_k_dense_replace", default=1 if family == "glm4_moe" else 0)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        # Step 1: the attention kind of layer i.
        if types is not None:
            kind = _KIND_OF_TYPE.get(types[i])
            if kind is None:
                raise f.error("layer_types", "entries full_attention / sliding_attention", types[i])
        elif window and use_sliding and (not qwen or i >= max_window_layers):
            kind = "sliding"
        else:
            kind = "gqa"
        attn = _gqa_spec(c, kind, window, qk_norm=qk_norm, sinks=family == "gpt_oss")
        if kind != "gqa" and not window:
            raise f.error("sliding_window", "an integer for sliding layers", window)
        t = blocks.gqa(f"{p}.self_attn", c.hidden, c.heads, c.kv_heads, c.head_dim,
                       qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                       sinks=family == "gpt_oss")  # fmt: skip
        # Step 2: dense MLP or mixture of experts.
        ffn, ft = _gqa_family_ffn(c, f, family, i, mlp_only, sparse_step, first_dense)
        layers.append(
            LayerSpec(index=i, attention=attn, ffn=ffn, tensors=tuple(t + ft + _norms(p, c.hidden)))
        )
    feats = _features(f)
    if family == "gpt_oss":
        feats.add("clamped_swiglu")
    mtp = 0
    if family == "glm4_moe":
        mtp = f.int("num_nextn_predict_layers", "num_mtp_layers", default=0)
        mtp *= _mtp_params(c, layers[-1])
    return Decoder(
        family=family, hidden_size=c.hidden, vocab_size=c.vocab, layers=layers,
        max_context=f.int("max_position_embeddings", default=0),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
        mtp_params=mtp, features=feats,
    )  # fmt: skip


def _gqa_family_ffn(c, f, family, i, mlp_only, sparse_step, first_dense):
    p = f"model.layers.{i}.mlp"
    if family in ("llama", "mistral", "qwen2", "qwen3"):
        return _dense(
            c, p, f.int("intermediate_size", minimum=1), bias=f.bool("mlp_bias", default=False)
        )
    if family == "mixtral":
        n = f.int("num_local_experts", "num_experts", minimum=1)
        return _moe(c, f, p, experts=n, top_k=f.int("num_experts_per_tok", minimum=1),
                    inter=f.int("intermediate_size", minimum=1), router="softmax", norm_topk=True)  # fmt: skip
    if family == "gpt_oss":
        return _gpt_oss_moe(c, f, p)
    if family in ("qwen2_moe", "qwen3_moe"):
        aliases = ("num_local_experts",) if family == "qwen3_moe" else ()
        n = f.int("num_experts", *aliases, minimum=0)
        if i in mlp_only or n == 0 or (i + 1) % sparse_step != 0:
            return _dense(c, p, f.int("intermediate_size", minimum=1))
        shared = f.int("shared_expert_intermediate_size", default=0) if family == "qwen2_moe" else 0
        return _moe(c, f, p, experts=n, top_k=f.int("num_experts_per_tok", minimum=1),
                    inter=f.int("moe_intermediate_size", minimum=1), router="softmax",
                    shared=shared, shared_gate=shared > 0, shared_name="shared_expert",
                    norm_topk=f.bool("norm_topk_prob", default=False))  # fmt: skip
    # glm4_moe: DeepSeek-V3 routing on GQA attention.
    if i < first_dense:
        return _dense(c, p, f.int("intermediate_size", minimum=1))
    inter = f.int("moe_intermediate_size", minimum=1)
    return _moe(c, f, p, experts=f.int("n_routed_experts", "num_local_experts", minimum=1),
                top_k=f.int("num_experts_per_tok", minimum=1), inter=inter, router="sigmoid",
                shared=inter * f.int("n_shared_experts", default=1),
                n_shared=f.int("n_shared_experts", default=1), correction=True,
                groups=(f.int("n_group", default=1, minimum=1), f.int("topk_group", default=1, minimum=1)),
                norm_topk=f.bool("norm_topk_prob", default=True),
                scaling=f.float("routed_scaling_factor", default=1.0))  # fmt: skip


def _gpt_oss_moe(c: _Common, f: ConfigFields, p: str) -> tuple[FfnSpec, list[TensorSpec]]:
    """gpt-oss experts: fused gate_up [2I, H] with bias, down [H, I] with bias; router with bias."""
    n = f.int("num_local_experts", "num_experts", minimum=1)
    inter = f.int("intermediate_size", minimum=1)
    top_k = f.int("num_experts_per_tok", "experts_per_token", minimum=1)
    t = blocks.router(f"{p}.router", c.hidden, n, bias=True)
    t += blocks.linear(
        f"{p}.experts.gate_up_proj", 2 * inter, c.hidden, "experts", bias=True, copies=n
    )
    t += blocks.linear(f"{p}.experts.down_proj", c.hidden, inter, "experts", bias=True, copies=n)
    spec = FfnSpec(kind="moe", activation="clamped_swiglu", num_experts=n, top_k=top_k,
                   expert_intermediate_size=inter, expert_hidden_size=c.hidden, router="softmax",
                   norm_topk_prob=True)  # fmt: skip
    return spec, t


def _mtp_params(c: _Common, last: LayerSpec) -> int:
    """One multi-token-prediction module: a decoder layer + enorm, hnorm, eh_proj [H, 2H], head norm."""
    return last.params + 3 * c.hidden + 2 * c.hidden * c.hidden


def deepseek_family(f: ConfigFields, family: str) -> Decoder:
    """deepseek_v2, deepseek_v3, kimi_k2: MLA attention, shared + routed experts."""
    c = _common(f)
    v3 = family != "deepseek_v2"
    mla_kw = _mla_kw(f)
    first_dense = f.int("first_k_dense_replace", default=0)
    freq = f.int("moe_layer_freq", default=1, minimum=1)
    # The names transformers' config class also accepts (its attribute_map).
    experts_alias, mtp_alias = (
        ("num_local_experts", ("num_mtp_layers",)) if v3 else ("num_experts", ())
    )
    n_routed = f.int("n_routed_experts", experts_alias, default=0)
    router = f.str("scoring_func", default="sigmoid" if v3 else "softmax")
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        attn = AttentionSpec(kind="mla", num_heads=c.heads, num_kv_heads=c.heads, **mla_kw)
        t = blocks.mla(f"{p}.self_attn", c.hidden, c.heads, **_mla_block_kw(mla_kw),
                       bias=f.bool("attention_bias", default=False))  # fmt: skip
        if n_routed and i >= first_dense and i % freq == 0:
            inter = f.int("moe_intermediate_size", minimum=1)
            n_shared = f.int("n_shared_experts", default=0)
            ffn, ft = _moe(c, f, f"{p}.mlp", experts=n_routed, top_k=f.int("num_experts_per_tok", minimum=1),
                           inter=inter, router=router, shared=inter * n_shared, n_shared=n_shared,
                           correction=v3, groups=(f.int("n_group", default=1, minimum=1),
                                                  f.int("topk_group", default=1, minimum=1)),
                           norm_topk=f.bool("norm_topk_prob", default=v3),
                           scaling=f.float("routed_scaling_factor", default=1.0))  # fmt: skip
        else:
            ffn, ft = _dense(c, f"{p}.mlp", f.int("intermediate_size", minimum=1))
        layers.append(
            LayerSpec(index=i, attention=attn, ffn=ffn, tensors=tuple(t + ft + _norms(p, c.hidden)))
        )
    return Decoder(
        family=family, hidden_size=c.hidden, vocab_size=c.vocab, layers=layers,
        max_context=f.int("max_position_embeddings", default=0),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
        mtp_params=f.int("num_nextn_predict_layers", *mtp_alias, default=0)
        * _mtp_params(c, layers[-1]),
        features=_features(f),
    )  # fmt: skip


def _mla_kw(f: ConfigFields) -> dict:
    nope = f.int("qk_nope_head_dim", minimum=1)
    rope = f.int("qk_rope_head_dim", minimum=0)
    return dict(
        head_dim=nope + rope, v_head_dim=f.int("v_head_dim", minimum=1),
        q_lora_rank=f.int("q_lora_rank", default=None, minimum=1),
        kv_lora_rank=f.int("kv_lora_rank", minimum=1), qk_rope_head_dim=rope, qk_nope_head_dim=nope,
    )  # fmt: skip


def _mla_block_kw(kw: dict) -> dict:
    return dict(q_lora_rank=kw["q_lora_rank"], kv_lora_rank=kw["kv_lora_rank"],
                nope_dim=kw["qk_nope_head_dim"], rope_dim=kw["qk_rope_head_dim"], v_dim=kw["v_head_dim"])  # fmt: skip


FamilyReader = Callable[[ConfigFields, str], Decoder]
