"""ModelSpec: a Hugging Face `config.json` as the operator graph, parameters, bytes and FLOPs that
the planner and the runtime consume.

Counting conventions (DeepSeek's): `active_params` is what one decoded token touches with the
input embedding excluded and the lm_head included; routed experts not chosen are excluded.
Parameters are logical (a packed mxfp4 byte holds two; scales are not parameters); buffers such as
a router's score-correction bias are reported apart (`buffer_elements`). A multimodal config's
language model is the spec; its vision tower is counted apart (`vision_params`), as is a
multi-token-prediction module (`mtp_params`) that the inference model does not build.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import InputError
from placement.layer_spec import LayerSpec, TensorSpec
from placement.quantization import DTYPE_BYTES, QuantSpec

KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
STATE_BYTES = 4
"""Linear-attention recurrent state is kept in fp32."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A parsed model. Layers are in execution order; `top_level` holds embedding, final norm and
    lm_head (no lm_head tensor when the embeddings are tied)."""

    model_type: str
    family: str
    source: str
    hidden_size: int
    vocab_size: int
    max_context: int
    tie_word_embeddings: bool
    weight_dtype: str
    """Dtype of unquantised weights as stored (config `torch_dtype` / `dtype`, bf16 by default)."""
    quantization: QuantSpec
    layers: tuple[LayerSpec, ...]
    top_level: tuple[TensorSpec, ...]
    vision_params: int = 0
    mtp_params: int = 0
    features: frozenset[str] = frozenset()

    # ----- parameters -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.is_moe)

    @property
    def embedding_params(self) -> int:
        return sum(t.numel for t in self.top_level if t.role == "embedding")

    @property
    def lm_head_params(self) -> int:
        """lm_head weights as used per token (the embedding matrix when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Language-model parameters, tied weights once, buffers excluded."""
        top = sum(t.numel for t in self.top_level if not t.buffer)
        return top + sum(layer.params for layer in self.layers)

    @property
    def expert_params(self) -> int:
        """All routed-expert parameters of all layers."""
        return sum(layer.routed_expert_params for layer in self.layers)

    @property
    def buffer_elements(self) -> int:
        return sum(layer.buffer_elements for layer in self.layers)

    @property
    def active_params(self) -> int:
        inactive = sum(layer.params - layer.active_params for layer in self.layers)
        lm_head_extra = self.lm_head_params if self.tie_word_embeddings else 0
        return self.total_params - inactive - self.embedding_params + lm_head_extra

    @property
    def active_params_with_embedding(self) -> int:
        return self.active_params + (0 if self.tie_word_embeddings else self.embedding_params)

    # ----- bytes ------------------------------------------------------------------------------
    def _unquantized_bytes(self, as_dtype: str | None) -> int:
        return DTYPE_BYTES[as_dtype or self.weight_dtype]

    def tensor_bytes(self, tensor: TensorSpec, as_dtype: str | None = None) -> int:
        """Stored bytes of one tensor; `as_dtype` ("bf16", "fp8", ...) ignores quantization_config."""
        if as_dtype is not None:
            return tensor.numel * (STATE_BYTES if tensor.buffer else DTYPE_BYTES[as_dtype])
        return self.quantization.tensor_bytes(tensor, self._unquantized_bytes(None))

    def layer_weight_bytes(self, index: int, as_dtype: str | None = None) -> int:
        """Bytes of layer `index` (all experts), scales and buffers included."""
        return sum(self.tensor_bytes(t, as_dtype) for t in self.layers[index].tensors)

    def expert_weight_bytes(self, index: int, as_dtype: str | None = None) -> int:
        """Bytes of one routed expert of layer `index` (0 in a dense layer)."""
        layer = self.layers[index]
        experts = [t for t in layer.tensors if t.role == "experts"]
        if not experts:
            return 0
        return sum(self.tensor_bytes(t, as_dtype) for t in experts) // layer.ffn.num_experts

    def top_level_weight_bytes(self, as_dtype: str | None = None) -> int:
        return sum(self.tensor_bytes(t, as_dtype) for t in self.top_level)

    def weight_bytes(self, as_dtype: str | None = None) -> int:
        """All language-model weights as stored (honouring quantization_config) or in `as_dtype`."""
        layers = sum(self.layer_weight_bytes(i, as_dtype) for i in range(self.num_layers))
        return layers + self.top_level_weight_bytes(as_dtype)

    def stored_elements(self) -> int:
        """Element count of the stored tensors (packed 4-bit bytes and scales count as elements)."""
        q = self.quantization
        total = 0
        for t in self.top_level + tuple(x for layer in self.layers for x in layer.tensors):
            if t.buffer:
                continue
            if q.applies_to(t) and q.weight_bits < 8:
                per_byte = 8 // q.weight_bits
                scale_bytes = q.tensor_bytes(t, 2) - t.numel // per_byte
                total += t.numel // per_byte + scale_bytes // max(q.scale_bytes, 1)
            elif q.applies_to(t):
                total += t.numel + (q.tensor_bytes(t, 2) - t.numel) // max(q.scale_bytes, 1)
            else:
                total += t.numel
        return total

    # ----- KV cache, state, FLOPs -------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV-cache bytes one token adds over all layers that keep per-token KV."""
        size = _kv_size(kv_dtype)
        return sum(layer.attention.kv_elements_per_token for layer in self.layers) * size

    @property
    def state_bytes_per_sequence(self) -> int:
        """Fixed fp32 recurrent state of the linear-attention layers, per sequence."""
        return sum(layer.attention.state_elements for layer in self.layers) * STATE_BYTES

    def conv_state_bytes_per_sequence(self, kv_dtype: str = "bf16") -> int:
        """Short-convolution state (KDA) per sequence, in the KV dtype."""
        return sum(layer.attention.conv_state_elements for layer in self.layers) * _kv_size(
            kv_dtype
        )

    def kv_bytes_at_context(self, context: int, kv_dtype: str = "bf16") -> int:
        """KV bytes of one sequence of `context` tokens; sliding/chunked layers keep at most their
        window (the fixed linear-attention state is not included: see state_bytes_per_sequence)."""
        size = _kv_size(kv_dtype)
        return sum(
            layer.attention.kv_elements_per_token * layer.attention.attended_tokens(context) * size
            for layer in self.layers
        )

    def flops_per_token(self, context: int) -> int:
        """Decode FLOPs of one token at position `context`.

        = 2 x active matmul parameters (attention projections, router, chosen + shared experts,
        dense MLPs, lm_head; norms, biases and the embedding lookup excluded)
        + sum over layers of AttentionSpec.score_flops(context) (QK^T and PV over the attended
        tokens for softmax attention, the state products for linear attention).
        """
        matmul = sum(layer.active_matmul_params for layer in self.layers) + self.lm_head_params
        return 2 * matmul + sum(layer.attention.score_flops(context) for layer in self.layers)

    def to_dict(self, *, context: int | None = None, kv_dtype: str = "bf16") -> dict:
        """The JSON form `moectl model inspect --json` prints (without the operator list)."""
        context = context or self.max_context
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.attention.kind] = kinds.get(layer.attention.kind, 0) + 1
        return {
            "model_type": self.model_type,
            "family": self.family,
            "source": self.source,
            "num_layers": self.num_layers,
            "moe_layers": len(self.moe_layers),
            "attention_layers": kinds,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "context": context,
            "context_exceeds_max": bool(self.max_context) and context > self.max_context,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "active_params_with_embedding": self.active_params_with_embedding,
            "embedding_params": self.embedding_params,
            "expert_params": self.expert_params,
            "buffer_elements": self.buffer_elements,
            "vision_params": self.vision_params,
            "total_params_with_vision": self.total_params + self.vision_params,
            "mtp_params": self.mtp_params,
            "kv_dtype": kv_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token(kv_dtype),
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "conv_state_bytes_per_sequence": self.conv_state_bytes_per_sequence(kv_dtype),
            "kv_bytes_at_context": self.kv_bytes_at_context(context, kv_dtype),
            "weight_dtype": self.weight_dtype,
            "quantization": self.quantization.method,
            "quantization_supported": self.quantization.supported,
            "weight_bytes": self.weight_bytes(),
            "weight_bytes_bf16": self.weight_bytes("bf16"),
            "flops_per_token": self.flops_per_token(context),
            "layers": [
                {
                    "index": layer.index,
                    "attention": layer.attention.kind,
                    "ffn": layer.ffn.kind,
                    "params": layer.params,
                    "active_params": layer.active_params,
                    "weight_bytes": self.layer_weight_bytes(layer.index),
                    "expert_weight_bytes": self.expert_weight_bytes(layer.index),
                }
                for layer in self.layers
            ],
        }


def _kv_size(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"kv dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[kv_dtype]


def read_config(path: str | Path) -> tuple[dict, str]:
    """The JSON object of a config.json (a file, or a directory holding one) and its display name."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    label = str(path) if p.name != "config.json" or Path(path).is_file() else str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{label}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{label}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(data, dict):
        raise InputError(
            f"{label}: expected a JSON object at the top level, got {type(data).__name__}"
        )
    return data, label
