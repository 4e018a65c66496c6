"""How a checkpoint stores its weights: the `quantization_config` of a config.json, as bytes.

Supported schemes (anything else is reported as-is and counted at the unquantised dtype):
- `fp8` with `weight_block_size` [bo, bi]: 1 byte per weight + one fp32 scale per bo x bi block
  (DeepSeek-V3); without a block size, one fp32 scale per output channel.
- `fbgemm_fp8`: 1 byte per weight + one fp32 scale per output channel.
- `mxfp4` (gpt-oss): routed-expert weights only, 4 bits per weight + one uint8 scale per 32.
- `compressed-tensors`: each config group's weights (`num_bits`, `strategy` group/channel/block/
  tensor, `group_size`, `scale_dtype`) on the `Linear` targets, minus the `ignore` list.
- `gptq` / `awq`: `bits` per weight + an fp16 scale and a packed zero point per group.
Ignore patterns: `re:<regex>` (matched from the start of the module path), shell globs, or a
substring of the module path (transformers' `modules_to_not_convert` semantics).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass

from placement.config_fields import ConfigFields
from placement.layer_spec import TensorSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_SCALE_BYTES = {"torch.uint8": 1, "torch.float8_e4m3fn": 1, "torch.float16": 2, "torch.bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """The stored format of the quantised weights; `method == "none"` when unquantised."""

    method: str
    weight_bits: int = 16
    block: tuple[int, int] | None = None
    """[out, in] block of one scale (fp8 block quantisation)."""
    group_size: int | None = None
    """Weights per scale along the input dimension (mxfp4, int4 groups)."""
    per_channel: bool = False
    scale_bytes: int = 0
    zero_point_bits: int = 0
    experts_only: bool = False
    include_lm_head: bool = False
    ignore: tuple[str, ...] = ()
    supported: bool = True

    @property
    def active(self) -> bool:
        return self.method != "none" and self.supported

    def applies_to(self, tensor: TensorSpec) -> bool:
        if not self.active or not tensor.quantizable or not tensor.matmul or len(tensor.shape) != 2:
            return False
        if self.experts_only and tensor.role != "experts":
            return False
        if tensor.role == "lm_head" and not self.include_lm_head:
            return False
        module = tensor.name.removesuffix(".weight")
        return not any(_matches(pattern, module) for pattern in self.ignore)

    def tensor_bytes(self, tensor: TensorSpec, unquantized_bytes: int) -> int:
        """Stored bytes of `tensor` (all copies), scales included."""
        if not self.applies_to(tensor):
            size = 4 if tensor.buffer else unquantized_bytes
            return tensor.numel * size
        out_dim, in_dim = tensor.shape
        data = math.ceil(out_dim * in_dim * self.weight_bits / 8)
        if self.block is not None:
            scales = math.ceil(out_dim / self.block[0]) * math.ceil(in_dim / self.block[1])
        elif self.group_size:
            scales = out_dim * math.ceil(in_dim / self.group_size)
        elif self.per_channel:
            scales = out_dim
        else:
            scales = 1
        extra = scales * self.scale_bytes + math.ceil(scales * self.zero_point_bits / 8)
        return (data + extra) * tensor.copies


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
    return pattern in module


def parse_quantization(fields: ConfigFields) -> QuantSpec:
    """The QuantSpec of a config's `quantization_config` section (method "none" when absent)."""
    q = fields.section("quantization_config")
    if q is None:
        return QuantSpec(method="none")
    method = q.str("quant_method", default="unknown")
    ignore = q.str_list("modules_to_not_convert", default=()) + q.str_list("ignore", default=())
    if method == "fp8":
        block = q.int_list("weight_block_size", default=None)
        if block is not None and len(block) != 2:
            raise q.error("weight_block_size", "a list of two integers", list(block))
        return QuantSpec(
            method="fp8",
            weight_bits=8,
            block=tuple(block) if block else None,
            per_channel=block is None,
            scale_bytes=4,
            ignore=ignore,
        )
    if method == "fbgemm_fp8":
        return QuantSpec(
            method=method, weight_bits=8, per_channel=True, scale_bytes=4, ignore=ignore
        )
    if method == "mxfp4":
        return QuantSpec(
            method=method,
            weight_bits=4,
            group_size=32,
            scale_bytes=1,
            experts_only=True,
            ignore=ignore,
        )
    if method in ("gptq", "awq"):
        bits = q.int("bits", "w_bit", default=4)
        group = q.int("group_size", "q_group_size", default=128)
        return QuantSpec(
            method=method, weight_bits=bits, group_size=group, scale_bytes=2, zero_point_bits=bits,
            include_lm_head=False, ignore=ignore,
        )  # fmt: skip
    if method == "compressed-tensors":
        return _compressed_tensors(q, ignore)
    return QuantSpec(method=method, supported=False, ignore=ignore)


def _compressed_tensors(q: ConfigFields, ignore: tuple[str, ...]) -> QuantSpec:
    """The first config group's weight scheme (checkpoints in practice carry one group)."""
    groups = q.section("config_groups", required=True)
    names = sorted(groups.data)
    if not names:
        raise groups.error("", "a non-empty object", {})
    group = groups.section(names[0], required=True)
    targets = group.str_list("targets", default=("Linear",))
    if "Linear" not in targets:
        return QuantSpec(method="compressed-tensors", supported=False, ignore=ignore)
    weights = group.section("weights", required=True)
    bits = weights.int("num_bits", minimum=1)
    strategy = weights.str("strategy", default="tensor")
    scale_dtype = weights.str("scale_dtype", default="torch.bfloat16")
    scale_bytes = _SCALE_BYTES.get(scale_dtype, 2 if bits < 8 else 4)
    symmetric = weights.bool("symmetric", default=True)
    block = None
    group_size = None
    if strategy == "group":
        group_size = weights.int("group_size", minimum=1)
    elif strategy == "block":
        shape = weights.int_list("block_structure")
        block = (shape[0], shape[1])
    return QuantSpec(
        method="compressed-tensors",
        weight_bits=bits,
        block=block,
        group_size=group_size,
        per_channel=strategy == "channel",
        scale_bytes=scale_bytes,
        zero_point_bits=0 if symmetric else bits,
        include_lm_head=True,
        ignore=ignore,
    )
