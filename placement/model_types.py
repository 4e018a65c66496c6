"""`model_type` -> family reader, multimodal unwrapping, and assembly of the ModelSpec."""

from __future__ import annotations

from pathlib import Path

from placement import blocks
from placement.config_fields import ConfigFields
from placement.families import Decoder, deepseek_family, gqa_family
from placement.families_hybrid import dbrx_family, kimi_linear_family, llama4_family, minimax_family
from placement.model_spec import ModelSpec, read_config
from placement.quantization import DTYPE_BYTES, parse_quantization

FAMILIES = {
    "llama": gqa_family,
    "mistral": gqa_family,
    "qwen2": gqa_family,
    "qwen3": gqa_family,
    "mixtral": gqa_family,
    "qwen2_moe": gqa_family,
    "qwen3_moe": gqa_family,
    "glm4_moe": gqa_family,
    "gpt_oss": gqa_family,
    "deepseek_v2": deepseek_family,
    "deepseek_v3": deepseek_family,
    "kimi_k2": deepseek_family,
    "kimi_linear": kimi_linear_family,
    "minimax": minimax_family,
    "minimax_m1": minimax_family,
    "minimax_text_01": minimax_family,
    "dbrx": dbrx_family,
    "llama4_text": llama4_family,
}
"""Text model types; each reads its fields with its family's reader."""

MULTIMODAL = {"kimi_k3": "kimi_linear", "llama4": "llama4_text", "kimi_vl": "deepseek_v3"}
"""Wrappers whose `text_config` is the language model (value: its model_type when unset)."""

_FAMILY_OF_TYPE = {"kimi_k2": "deepseek_v3", "minimax_m1": "minimax", "minimax_text_01": "minimax"}


def build_spec(top: ConfigFields, *, source: str) -> ModelSpec:
    model_type = top.str("model_type")
    text = top
    if model_type in MULTIMODAL:
        text = top.section("text_config", required=True)
        text_type = text.str("model_type", default=MULTIMODAL[model_type]) or MULTIMODAL[model_type]
    else:
        text_type = model_type
    if text_type not in FAMILIES:
        known = ", ".join(sorted(set(FAMILIES) | set(MULTIMODAL)))
        if text is top:
            return _meta_spec(top, source=source, known=known)
        field = f"{text.prefix}model_type"
        raise top.error(field, f"a supported model type ({known})", text_type).with_traceback(None)
    family = _FAMILY_OF_TYPE.get(text_type, text_type)
    decoder: Decoder = FAMILIES[text_type](text, family)
    quant_fields = text if text.has("quantization_config") else top
    dtype = text.str("torch_dtype", "dtype", default=None) or top.str(
        "torch_dtype", "dtype", default="bfloat16"
    )
    if dtype not in DTYPE_BYTES:
        raise top.error("torch_dtype", f"one of {', '.join(DTYPE_BYTES)}", dtype)
    return ModelSpec(
        model_type=model_type, family=decoder.family, source=source, hidden_size=decoder.hidden_size,
        vocab_size=decoder.vocab_size, max_context=decoder.max_context,
        tie_word_embeddings=decoder.tie_word_embeddings, weight_dtype=dtype,
        quantization=parse_quantization(quant_fields), layers=tuple(decoder.layers),
        top_level=tuple(_top_level(decoder)), vision_params=_vision_params(top),
        mtp_params=decoder.mtp_params, features=frozenset(decoder.features),
    )  # fmt: skip


def _meta_spec(top: ConfigFields, *, source: str, known: str) -> ModelSpec:
    """A model type outside our families: transformers' own module tree, if it knows the type.

    Imported here: transformers (and torch) load only for such configs."""
    from placement import meta_model

    if top.str("model_type") not in meta_model.known_model_types():
        raise meta_model.unknown_model_type_error(top, known).with_traceback(None)
    return meta_model.build_meta_spec(top, source=source)


def _top_level(d: Decoder) -> list:
    t = [
        blocks.TensorSpec(
            name=f"{d.embed_name}.weight", shape=(d.vocab_size, d.hidden_size), role="embedding",
            matmul=False, quantizable=False,
        )
    ]  # fmt: skip
    t += blocks.vector(f"{d.final_norm}.weight", d.hidden_size)
    if not d.tie_word_embeddings:
        t += blocks.linear("lm_head", d.vocab_size, d.hidden_size, "lm_head")
    return t


def _vision_params(top: ConfigFields) -> int:
    """Parameters of a MoonViT-style vision tower + patch-merger projector (Kimi-K3 / Kimi-VL
    `vision_config` with vt_* fields); 0 for configs without one we can size.

    patch embedding (3 x p x p x width), learned 2-D position table (h x w x width), per layer two
    RMSNorms, fused qkv [3 x qkv, width], out [width, qkv], a 2-layer MLP; final norm; projector:
    LayerNorm(width), Linear(merged, merged), Linear(merged, text_hidden) with biases, where
    merged = width x merge_h x merge_w.
    """
    v = top.section("vision_config")
    if v is None or not v.has("vt_hidden_size"):
        return 0
    width = v.int("vt_hidden_size", minimum=1)
    inter = v.int("vt_intermediate_size", minimum=1)
    qkv = v.int("qkv_hidden_size", default=width, minimum=1)
    layers = v.int("vt_num_hidden_layers", minimum=0)
    patch = v.int("patch_size", minimum=1)
    bias = v.bool("linear_bias", default=True)
    attn_bias = v.bool("attn_bias", default=bias)
    merge = v.int_list("merge_kernel_size", default=(2, 2))
    text_hidden = v.int(
        "text_hidden_size",
        default=top.section("text_config").int("hidden_size") if top.has("text_config") else width,
    )
    per_layer = 2 * width + 3 * qkv * width + qkv * width + 2 * width * inter
    per_layer += (4 * qkv if attn_bias else 0) + ((inter + width) if bias else 0)
    embed = 3 * patch * patch * width + (
        width if v.bool("patch_embed_proj_bias", default=True) else 0
    )
    pos = v.int("init_pos_emb_height", default=0) * v.int("init_pos_emb_width", default=0) * width
    merged = width * merge[0] * merge[1]
    projector = 2 * width + merged * merged + merged + merged * text_hidden + text_hidden
    return embed + pos + layers * per_layer + width + projector


def load_model_spec(path: str | Path) -> ModelSpec:
    """Parse a config.json (file or directory) into a ModelSpec; InputError on bad input."""
    data, label = read_config(path)
    return build_spec(ConfigFields(data, label=label), source=str(path))
