"""`moectl convert`: rewrite a checkpoint in another precision or shard layout, one tensor at a time.

    moectl convert MODEL_DIR OUT_DIR [--dtype bf16|fp8] [--reshard N]

- `bf16`: every floating tensor stored as bfloat16 (fp8 / mxfp4 sources are dequantised first);
  `quantization_config` is dropped.
- `fp8`: every 2-D matmul weight of a decoder layer (attention projections, experts, shared
  experts, dense MLPs) becomes float8 e4m3 with one float32 `<name>_scale_inv` per 128 x 128
  block (the DeepSeek-V3 form `actors.model.weights` dequantises: w = fp8 * scale_inv[r // 128, c // 128],
  scale_inv = max|block| / 448); embeddings, lm_head, norms and routers keep their stored dtype.
- `--reshard N`: N safetensors files (`model-0000k-of-0000N.safetensors`) split by bytes in name
  order, with `model.safetensors.index.json`; default: as many files as the source.

Streaming: the output header is computed from the source headers first; then each tensor is read
(`actors.model.weights.read_tensor`, a box of one tensor through safe_open), converted and appended to
its file, so memory holds one tensor at a time. The safetensors layout (8-byte little-endian
header length, JSON header padded to 8 bytes, raw little-endian data) is written directly.
Tokenizer and other side files are copied.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.errors import InputError

DTYPES = ("bf16", "fp8")
FP8_MAX = 448.0
BLOCK = (128, 128)
_ST_NAME = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32",
            torch.uint8: "U8", torch.bool: "BOOL", torch.float64: "F64"}  # fmt: skip
_FROM_ST = {v: k for k, v in _ST_NAME.items()}
_NOT_QUANTISED = ("embed_tokens", "lm_head", "norm", ".mlp.gate.", ".router.")


@dataclass(frozen=True, kw_only=True)
class OutTensor:
    """One tensor of the output: its name, dtype, shape, the source tensor and how to make it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: str
    role: str
    """copy | fp8 (the codes) | scale (the block scales of `source`)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def quantise_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (codes [R, C] float8 e4m3, scale_inv [ceil(R/b0), ceil(C/b1)] float32)."""
    r, c = w.shape
    b0, b1 = block
    gr, gc = -(-r // b0), -(-c // b1)
    padded = torch.zeros(gr * b0, gc * b1, dtype=torch.float32)
    padded[:r, :c] = w.to(torch.float32)
    tiles = padded.view(gr, b0, gc, b1)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gr * b0, gc * b1)
    return codes[:r, :c].to(torch.float8_e4m3fn), scale


def _quantisable(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return (len(shape) == 2 and dtype.is_floating_point and name.endswith(".weight")
            and ".layers." in name and not any(k in name for k in _NOT_QUANTISED))  # fmt: skip


def plan_tensors(index, dtype: str) -> list[OutTensor]:
    """The output tensors in write order (a weight's scales right after it)."""
    out = []
    for name in index.logical_names():
        entry = index.entries.get(name)
        stored = _FROM_ST.get(entry.dtype) if entry is not None else torch.float32
        if stored is None:
            raise InputError(
                f"{index.directory}: tensor {name} has dtype {entry.dtype}, which convert does not handle"
            )
        if stored == torch.float8_e4m3fn or name not in index.entries:
            stored = torch.float32  # dequantised on read
        shape = index.logical_shape(name)
        if dtype == "fp8" and _quantisable(name, shape, stored):
            out.append(
                OutTensor(
                    name=name, dtype=torch.float8_e4m3fn, shape=shape, source=name, role="fp8"
                )
            )
            grid = (-(-shape[0] // BLOCK[0]), -(-shape[1] // BLOCK[1]))
            out.append(
                OutTensor(
                    name=f"{name}_scale_inv",
                    dtype=torch.float32,
                    shape=grid,
                    source=name,
                    role="scale",
                )
            )
            continue
        was_quantised = name not in index.entries or f"{name}_scale_inv" in index.entries
        target = stored
        if stored.is_floating_point and (dtype == "bf16" or was_quantised):
            target = torch.bfloat16
        out.append(OutTensor(name=name, dtype=target, shape=shape, source=name, role="copy"))
    return out


def _split(tensors: list[OutTensor], files: int) -> list[list[OutTensor]]:
    """Consecutive groups of about equal bytes; a scale stays with its weight."""
    total = sum(t.nbytes for t in tensors) or 1
    groups: list[list[OutTensor]] = [[] for _ in range(files)]
    done = 0
    for t in tensors:
        k = min(files - 1, done * files // total)
        if t.role == "scale":
            k = next(i for i, g in enumerate(groups) if g and g[-1].name == t.source)
        groups[k].append(t)
        done += t.nbytes
    return groups


def _header(tensors: list[OutTensor]) -> bytes:
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        meta[t.name] = {"dtype": _ST_NAME[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def convert(model_dir: str | Path, out_dir: str | Path, *, dtype: str = "bf16",
            reshard: int | None = None) -> dict:  # fmt: skip
    """Write the converted checkpoint; returns {files, tensors, bytes, dtype}."""
    from actors.model.weights import CheckpointIndex, read_tensor

    src, dst = Path(model_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if reshard is not None and reshard < 1:
        raise InputError(f"--reshard {reshard}: expected a positive number of files")
    if not src.is_dir():
        raise InputError(f"{src}: not a checkpoint directory")
    if dst.resolve() == src.resolve():
        raise InputError(f"OUT_DIR {dst} is MODEL_DIR: write the converted copy elsewhere")
    if dst.exists() and any(dst.iterdir()):
        raise InputError(f"OUT_DIR {dst} exists and is not empty")
    index = CheckpointIndex.open(src)
    # Step 1: the output tensors and their files, from the headers alone.
    tensors = plan_tensors(index, dtype)
    files = reshard or len({e.file for e in index.entries.values()})
    groups = [g for g in _split(tensors, files) if g]
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))
    ]  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    # Step 2: stream every tensor into its file.
    for fname, group in zip(names, groups, strict=True):
        header = _header(group)
        with open(dst / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(header)))
            fh.write(header)
            pending: tuple[str, torch.Tensor] | None = None
            for t in group:
                if t.role == "scale":
                    value = (
                        pending[1]
                        if pending and pending[0] == t.source
                        else quantise_fp8_blocks(read_tensor(index, t.source))[1]
                    )
                else:
                    value = read_tensor(index, t.source)
                    if t.role == "fp8":
                        value, scale = quantise_fp8_blocks(value)
                        pending = (t.name, scale)
                    else:
                        value = value.to(t.dtype)
                data = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                if len(data) != t.nbytes:
                    raise RuntimeError(
                        f"{t.name}: wrote {len(data)} bytes, the header says {t.nbytes}"
                    )
                fh.write(data)
    # Step 3: index, config and side files.
    if len(groups) > 1:
        weight_map = {t.name: fname for fname, g in zip(names, groups, strict=True) for t in g}
        total = sum(t.nbytes for t in tensors)
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    config = dict(index.config)
    if dtype == "bf16":
        config.pop("quantization_config", None)
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "torch_dtype":
                config[key] = "bfloat16"
    else:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(BLOCK)}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for p in src.iterdir():
        if (
            p.is_file()
            and p.suffix != ".safetensors"
            and p.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(p, dst / p.name)
    return {
        "files": names,
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "dtype": dtype,
    }
