"""Family readers for hybrid and oddly-named configs: Kimi Linear / Kimi-K3 (KDA + MLA, latent MoE),
MiniMax (lightning + softmax attention), DBRX (its own field names) and Llama 4 (chunked attention,
interleaved MoE)."""

from __future__ import annotations

from placement import blocks
from placement.config_fields import ConfigFields
from placement.families import (
    Decoder,
    _common,
    _dense,
    _features,
    _gqa_spec,
    _layer_types,
    _mla_block_kw,
    _mla_kw,
    _moe,
    _norms,
)
from placement.layer_spec import AttentionSpec, FfnSpec, LayerSpec


def kimi_linear_family(f: ConfigFields, family: str) -> Decoder:
    """Kimi Linear and Kimi-K3 text models.

    Layer kinds come from `linear_attn_config.full_attn_layers` / `kda_layers` (1-indexed in the
    checkpoint), else `layer_types`, else every 4th layer (1-based) is MLA. Kimi-K3 adds, when its
    fields are present: a gated MLA output (`mla_use_output_gate`: g_proj [heads*v, H]), a
    full-rank KDA output gate (`use_full_rank_gate`) and a latent MoE (`routed_expert_hidden_size`
    < hidden_size: experts read/write a smaller width through two projections and an RMSNorm).
    """
    c = _common(f)
    lin = f.section("linear_attn_config") or ConfigFields(
        {}, label=f.label, prefix=f"{f.prefix}linear_attn_config."
    )
    lin_heads = lin.int("num_heads", default=f.int("linear_num_heads", default=32), minimum=1)
    lin_dim = lin.int("head_dim", default=f.int("linear_head_dim", default=128), minimum=1)
    kernel = lin.int("short_conv_kernel_size", default=f.int("linear_conv_kernel_dim", default=4))
    full_rank_gate = lin.bool("use_full_rank_gate", default=False)
    kinds = _kimi_layer_kinds(f, lin, c.num_layers)
    mla_kw = _mla_kw(f)
    gate = f.bool("mla_use_output_gate", default=False)
    first_dense = f.int("first_k_dense_replace", default=1)
    mlp_types = f.str_list("mlp_layer_types", default=None)
    latent = f.int("routed_expert_hidden_size", default=c.hidden, minimum=1)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        if kinds[i] == "mla":
            attn = AttentionSpec(
                kind="mla", num_heads=c.heads, num_kv_heads=c.heads, output_gate=gate, **mla_kw
            )
            t = blocks.mla(f"{p}.self_attn", c.hidden, c.heads, **_mla_block_kw(mla_kw), output_gate=gate,
                           bias=f.bool("attention_bias", default=False))  # fmt: skip
        else:
            attn = AttentionSpec(kind="linear", num_heads=lin_heads, num_kv_heads=lin_heads,
                                 head_dim=lin_dim, v_head_dim=lin_dim, conv_kernel=kernel)  # fmt: skip
            t = blocks.kda(
                f"{p}.self_attn",
                c.hidden,
                lin_heads,
                lin_dim,
                kernel,
                full_rank_gate=full_rank_gate,
            )
        sparse = mlp_types[i] == "sparse" if mlp_types is not None else i >= first_dense
        if sparse:
            ffn, ft = _kimi_moe(c, f, f"{p}.mlp", latent)
        else:
            ffn, ft = _dense(c, f"{p}.mlp", f.int("intermediate_size", minimum=1))
        layers.append(
            LayerSpec(index=i, attention=attn, ffn=ffn, tensors=tuple(t + ft + _norms(p, c.hidden)))
        )
    feats = _features(f)
    if f.bool("mla_use_nope", default=False):
        feats.add("mla_nope")
    if c.activation not in ("silu", "swish"):
        feats.add(f"activation_{c.activation}")
    return Decoder(
        family=family, hidden_size=c.hidden, vocab_size=c.vocab, layers=layers,
        max_context=f.int("max_position_embeddings", "model_max_length", default=1048576),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False), features=feats,
    )  # fmt: skip


def _kimi_layer_kinds(f: ConfigFields, lin: ConfigFields, n: int) -> list[str]:
    if lin.has("full_attn_layers") and lin.has("kda_layers"):
        kinds = [""] * n
        for name, kind in (("full_attn_layers", "mla"), ("kda_layers", "linear")):
            for layer in lin.int_list(name):
                if not 1 <= layer <= n:
                    raise lin.error(name, f"1-based layer numbers in 1..{n}", layer)
                kinds[layer - 1] = kind
        if "" in kinds:
            missing = kinds.index("") + 1
            raise lin.error(
                "full_attn_layers",
                f"lists covering every layer (layer {missing} is in neither)",
                missing,
            )
        return kinds
    types = _layer_types(f, n)
    if types is not None:
        return ["mla" if t == "full_attention" else "linear" for t in types]
    return ["mla" if i and i % 4 == 0 else "linear" for i in range(n)]


def _kimi_moe(c, f: ConfigFields, p: str, latent: int):
    inter = f.int("moe_intermediate_size", minimum=1)
    n_shared = f.int("num_shared_experts", "n_shared_experts", default=1)
    ffn, t = _moe(
        c, f, p, experts=f.int("num_experts", "num_local_experts", "n_routed_experts", minimum=1),
        top_k=f.int("num_experts_per_token", "num_experts_per_tok", minimum=1), inter=inter,
        router=f.str("moe_router_activation_func", default="sigmoid"), shared=inter * n_shared,
        n_shared=n_shared, correction=True,
        groups=(f.int("num_expert_group", "n_group", default=1, minimum=1), f.int("topk_group", default=1, minimum=1)),
        norm_topk=f.bool("moe_renormalize", "norm_topk_prob", default=True),
        scaling=f.float("routed_scaling_factor", default=1.0),
    )  # fmt: skip
    if latent == c.hidden:
        return ffn, t
    # Latent MoE: experts work at width `latent`; the checkpoint keeps the two projections
    # unquantised (its stored element count matches only with the routed experts packed).
    experts = [x for x in t if x.role == "experts"]
    rest = [x for x in t if x.role != "experts"]
    experts = blocks.swiglu(f"{p}.experts.0", latent, inter, "experts", copies=ffn.num_experts)
    lat = blocks.linear(f"{p}.latent_down_proj", latent, c.hidden, "latent", quantizable=False)
    lat += blocks.linear(f"{p}.latent_up_proj", c.hidden, latent, "latent", quantizable=False)
    if f.bool("latent_moe_use_norm", default=False):
        lat += blocks.vector(f"{p}.latent_norm.weight", latent)
    ffn = FfnSpec(**{**ffn.__dict__, "expert_hidden_size": latent})
    return ffn, rest + experts + lat


def minimax_family(f: ConfigFields, family: str) -> Decoder:
    """MiniMax-Text-01 / M1: lightning attention layers (attn_type_list 0) and softmax GQA layers
    (1); every layer MoE with a softmax top-k router."""
    c = _common(f)
    types = _layer_types(f, c.num_layers)
    attn_list = f.int_list("attn_type_list", default=None)
    if types is None and attn_list is not None:
        if len(attn_list) != c.num_layers:
            raise f.error("attn_type_list", f"a list of {c.num_layers} entries", list(attn_list))
        types = tuple("full_attention" if a == 1 else "linear_attention" for a in attn_list)
    if types is None:
        types = tuple(
            "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(c.num_layers)
        )
    shared = f.int("shared_intermediate_size", default=0)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        if types[i] == "linear_attention":
            attn = AttentionSpec(kind="lightning", num_heads=c.heads, num_kv_heads=c.heads,
                                 head_dim=c.head_dim, v_head_dim=c.head_dim)  # fmt: skip
            t = blocks.lightning(f"{p}.self_attn", c.hidden, c.heads, c.head_dim)
        else:
            attn = _gqa_spec(c, "gqa", None)
            t = blocks.gqa(f"{p}.self_attn", c.hidden, c.heads, c.kv_heads, c.head_dim)
        ffn, ft = _moe(c, f, f"{p}.mlp", experts=f.int("num_local_experts", "num_experts", minimum=1),
                       top_k=f.int("num_experts_per_tok", minimum=1), inter=f.int("intermediate_size", minimum=1),
                       router="softmax", shared=shared, norm_topk=True)  # fmt: skip
        layers.append(
            LayerSpec(index=i, attention=attn, ffn=ffn, tensors=tuple(t + ft + _norms(p, c.hidden)))
        )
    return Decoder(
        family=family, hidden_size=c.hidden, vocab_size=c.vocab, layers=layers,
        max_context=f.int("max_position_embeddings", default=0),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False), features=_features(f),
    )  # fmt: skip


def dbrx_family(f: ConfigFields, family: str) -> Decoder:
    """DBRX: fused Wqkv, LayerNorm without bias, 16 fine-grained experts (w1, v1, w2)."""
    hidden = f.int("d_model", "hidden_size", minimum=1)
    heads = f.int("n_heads", "num_attention_heads", minimum=1)
    attn_cfg = f.section("attn_config", required=True)
    ffn_cfg = f.section("ffn_config", required=True)
    kv_heads = attn_cfg.int("kv_n_heads", default=1, minimum=1)
    head_dim = hidden // heads
    n_exp = ffn_cfg.int("moe_num_experts", minimum=1)
    top_k = ffn_cfg.int("moe_top_k", minimum=1)
    inter = ffn_cfg.int("ffn_hidden_size", minimum=1)
    if top_k > n_exp:
        raise ffn_cfg.error("moe_top_k", f"at most the {n_exp} experts", top_k)
    layers = []
    for i in range(f.int("n_layers", "num_hidden_layers", minimum=1)):
        p = f"transformer.blocks.{i}"
        attn = AttentionSpec(
            kind="gqa",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
        )
        t = blocks.vector(f"{p}.norm_attn_norm.norm_1.weight", hidden)
        t += blocks.linear(
            f"{p}.norm_attn_norm.attn.Wqkv", hidden + 2 * kv_heads * head_dim, hidden, "attention"
        )
        t += blocks.linear(f"{p}.norm_attn_norm.attn.out_proj", hidden, hidden, "attention")
        t += blocks.vector(f"{p}.norm_attn_norm.norm_2.weight", hidden)
        t += blocks.router(f"{p}.ffn.router.layer", hidden, n_exp)
        t += blocks.swiglu(f"{p}.ffn.experts.mlp.0", hidden, inter, "experts", copies=n_exp)
        ffn = FfnSpec(kind="moe", num_experts=n_exp, top_k=top_k, expert_intermediate_size=inter,
                      expert_hidden_size=hidden, router="softmax", norm_topk_prob=True)  # fmt: skip
        layers.append(LayerSpec(index=i, attention=attn, ffn=ffn, tensors=tuple(t)))
    feats = {"layernorm"}
    if attn_cfg.has("clip_qkv"):
        feats.add("qkv_clip")
    return Decoder(
        family=family, hidden_size=hidden, vocab_size=f.int("vocab_size", minimum=1), layers=layers,
        max_context=f.int("max_seq_len", "max_position_embeddings", default=0),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
        embed_name="transformer.wte", final_norm="transformer.norm_f", features=feats,
    )  # fmt: skip


def llama4_family(f: ConfigFields, family: str) -> Decoder:
    """Llama 4 text: chunked attention on RoPE layers (NoPE every 4th), MoE on `moe_layers` with
    one shared expert and a sigmoid top-k router; dense layers use `intermediate_size_mlp`."""
    c = _common(f)
    nope_every = f.int("no_rope_layer_interval", default=4, minimum=1)
    no_rope = f.int_list("no_rope_layers", default=None) or tuple(
        int((i + 1) % nope_every != 0) for i in range(c.num_layers)
    )
    chunk = f.int("attention_chunk_size", default=8192)
    types = _layer_types(f, c.num_layers) or tuple(
        "chunked_attention" if r and chunk else "full_attention" for r in no_rope
    )
    step = f.int("interleave_moe_layer_step", default=1, minimum=1)
    moe_layers = set(f.int_list("moe_layers", default=None) or range(step - 1, c.num_layers, step))
    bias = f.bool("attention_bias", default=False)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        kind = "chunked" if types[i] == "chunked_attention" else "gqa"
        attn = _gqa_spec(c, kind, chunk)
        t = blocks.gqa(
            f"{p}.self_attn", c.hidden, c.heads, c.kv_heads, c.head_dim, qkv_bias=bias, o_bias=bias
        )
        if i in moe_layers:
            inter = f.int("intermediate_size", minimum=1)
            ffn, ft = _moe(c, f, f"{p}.feed_forward", experts=f.int("num_local_experts", minimum=1),
                           top_k=f.int("num_experts_per_tok", minimum=1), inter=inter, router="sigmoid",
                           shared=inter, router_name="router", shared_name="shared_expert")  # fmt: skip
        else:
            ffn, ft = _dense(c, f"{p}.feed_forward", f.int("intermediate_size_mlp", minimum=1))
        layers.append(
            LayerSpec(index=i, attention=attn, ffn=ffn, tensors=tuple(t + ft + _norms(p, c.hidden)))
        )
    feats = _features(f)
    if f.bool("use_qk_norm", default=True):
        feats.add("l2_qk_norm")
    return Decoder(
        family=family, hidden_size=c.hidden, vocab_size=c.vocab, layers=layers,
        max_context=f.int("max_position_embeddings", default=0),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False), features=feats,
    )  # fmt: skip
