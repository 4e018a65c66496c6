"""Shard-aware weight loading from a Hugging Face safetensors checkpoint directory.

A rank reads only the boxes (`Share`s) its `StageModel` lists, through safetensors `safe_open` +
`get_slice`, never whole files, and records every box it read (`ReadLog`). Everything is checked
before the first byte is read: a missing tensor or a wrong shape is an InputError naming the
tensor and the rank. Quantised storage is dequantised on load:

- fp8 e4m3 weights with `<name>_scale_inv` block scales (DeepSeek-V3, Kimi K2; block 128x128 or
  `quantization_config.weight_block_size`): w = fp8 * scale_inv[row // 128, col // 128].
- mxfp4 (gpt-oss layout): `<name>_blocks` uint8 [..., G, 16] packs 32 fp4 e2m1 values per group
  (low nibble first) and `<name>_scales` uint8 [..., G] holds e8m0 exponents (bias 127):
  w[..., 32g + j] = fp4 * 2^(scale - 127); the logical tensor is [..., G * 32].

`completeness()` adds up every rank's shares against the checkpoint: which tensors nobody owns,
which are covered only in part.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from actors.model.arch import ArchConfig, is_native
from actors.model.layers.share import Share
from actors.model.stage import StageModel
from cluster.errors import CheckFailed, InputError

_MXFP4_GROUP = 32
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One stored tensor: file, shape, safetensors dtype name (F32, BF16, F8_E4M3, U8 ...)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, kw_only=True)
class Read:
    """One box read from one stored tensor: (start, stop) along every dimension."""

    name: str
    box: tuple[tuple[int, int], ...]


@dataclass
class ReadLog:
    """Every box a rank read, in order (quantised tensors log their blocks/scales tensors too)."""

    rank: int | None = None
    reads: list[Read] = field(default_factory=list)

    def boxes(self) -> set[tuple[str, tuple[tuple[int, int], ...]]]:
        return {(r.name, r.box) for r in self.reads}


class CheckpointIndex:
    """The tensors of a checkpoint directory (config.json + *.safetensors [+ index json]), headers only."""

    def __init__(
        self, directory: Path, config: dict[str, Any], entries: dict[str, TensorEntry]
    ) -> None:
        self.directory, self.config, self.entries = directory, config, entries
        self.block_size = tuple(
            (config.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
        )
        self._logical = self._logical_shapes()

    @classmethod
    def open(cls, directory: Path | str) -> CheckpointIndex:
        d = Path(directory)
        cfg_path = d / "config.json"
        if not cfg_path.is_file():
            raise InputError(f"{d}: no config.json (expected a Hugging Face checkpoint directory)")
        from placement.model_spec import read_config  # the one reader of config.json

        config, _ = read_config(cfg_path)
        index_path = d / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map") or {}
            files = sorted({d / f for f in weight_map.values()})
        else:
            files = sorted(d.glob("*.safetensors"))
        if not files:
            raise InputError(f"{d}: no *.safetensors files")
        entries: dict[str, TensorEntry] = {}
        for path in files:
            if not path.is_file():
                raise InputError(f"{index_path}: lists {path.name}, which does not exist")
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    sl = f.get_slice(name)
                    entries[name] = TensorEntry(
                        name=name, file=path, shape=tuple(sl.get_shape()), dtype=sl.get_dtype()
                    )
        return cls(d, config, entries)

    def arch(self) -> ArchConfig:
        """The native families' ArchConfig, else the generic path's (transformers' modules)."""
        source = str(self.directory / "config.json")
        if is_native(self.config.get("model_type")):
            return ArchConfig.from_hf(self.config, source=source)
        from actors.model.generic import generic_arch

        return generic_arch(self.config, source)

    def _logical_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for name, e in self.entries.items():
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in self.entries:
                continue
            if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in self.entries:
                out[name[: -len("_blocks")]] = (*e.shape[:-2], e.shape[-2] * _MXFP4_GROUP)
            elif name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in self.entries:
                continue
            else:
                out[name] = e.shape
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._logical

    def logical_names(self) -> list[str]:
        """Tensor names after dequantisation (blocks/scales pairs and scale_inv folded in)."""
        return sorted(self._logical)

    def logical_shape(self, name: str) -> tuple[int, ...]:
        return self._logical[name]


def check_shares(
    shares: Sequence[Share], index: CheckpointIndex, *, rank: int | None = None
) -> None:
    """InputError for the first share whose tensor is missing or has another shape."""
    who = f"rank {rank}: " if rank is not None else ""
    for s in shares:
        if s.name not in index:
            raise InputError(
                f"{who}checkpoint {index.directory} has no tensor {s.name} (expected shape {list(s.shape)})"
            )
        got = index.logical_shape(s.name)
        if got != s.shape:
            raise InputError(
                f"{who}tensor {s.name} in {index.directory} has shape {list(got)}, expected {list(s.shape)}"
            )


def load_stage(model: StageModel, index: CheckpointIndex, *, rank: int | None = None) -> ReadLog:
    """Fill `model`'s parameters from the checkpoint, reading only its shares. Returns the read log.

    Step 1: list the shares and check them all against the checkpoint (nothing read yet).
    Step 2: read each box with `get_slice`, dequantise, copy into the parameter.
    """
    shares = model.shares(index)
    check_shares(shares, index, rank=rank)
    params = dict(model.named_parameters())
    log = ReadLog(rank=rank)
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}

        def handle(name: str) -> Any:
            path = index.entries[name].file
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path]

        for s in shares:
            target = params[s.param][tuple(slice(*d) if isinstance(d, tuple) else d for d in s.dst)]
            value = _read_box(index, s.name, s.box, handle, log)
            if value.numel() != target.numel():
                raise RuntimeError(
                    f"share {s.name}{list(s.box)} has {value.numel()} elements; {s.param} wants {list(target.shape)}"
                )
            target.copy_(value.reshape(target.shape).to(target.dtype))
    return log


def load_stage_model(
    checkpoint_dir: Path | str,
    *,
    layer_range: tuple[int, int],
    tp_rank: int = 0,
    tp_size: int = 1,
    local_experts: Sequence[int] | None = None,
    rank: int | None = None,
    dtype: str | torch.dtype | None = None,
    **model_kwargs: Any,
) -> tuple[StageModel, ReadLog]:
    """Build the stage for (layer_range, tp slice, experts) and load its shares.

    `first`/`last` default to whether the range starts at 0 / ends at the last layer;
    `dtype`: the compute dtype of the parameters (a torch dtype or its name, `bfloat16`;
    None: torch's default, float32); `model_kwargs` go to `StageModel` (tp_reduce, ep, device).
    """
    index = CheckpointIndex.open(checkpoint_dir)
    arch = index.arch()
    model_kwargs.setdefault("first", layer_range[0] == 0)
    model_kwargs.setdefault("last", layer_range[1] == arch.num_layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(compute_dtype(dtype))
    try:
        if arch.generic:
            return _generic(
                index, arch, layer_range, tp_size, local_experts, rank, dtype, model_kwargs
            )
        model = StageModel(
            arch,
            layer_range=layer_range,
            tp_rank=tp_rank,
            tp_size=tp_size,
            local_experts=local_experts,
            **model_kwargs,
        )
    finally:
        torch.set_default_dtype(previous)
    return model, load_stage(model, index, rank=rank)


def _generic(index, arch, layer_range, tp_size, local_experts, rank, dtype, kw):
    """load_stage_model over transformers' own layers (`actors/model/generic.py`): whole
    layers over pipeline stages, experts over EP ranks (TP refused, naming the model type)."""
    from actors.model.generic import load_generic_stage, refuse_tp

    refuse_tp(arch, tp_size, str(index.directory))
    stage = load_generic_stage(
        index.directory, arch, index.config, layer_range=layer_range,
        dtype=compute_dtype(dtype), first=kw["first"], last=kw["last"], device=kw.get("device"),
        local_experts=local_experts, ep=kw.get("ep"),
    )  # fmt: skip
    return stage, ReadLog(rank=rank)


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A compute dtype from its name (`bfloat16`) or itself; None: torch's default."""
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in COMPUTE_DTYPES:
        raise InputError(f"dtype={dtype!r}; expected one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[dtype]


def read_tensor(
    index: CheckpointIndex,
    name: str,
    box: tuple[tuple[int, int], ...] | None = None,
    log: ReadLog | None = None,
) -> torch.Tensor:
    """One logical tensor (or a box of it), dequantised; for validators and tools."""
    if name not in index:
        raise InputError(f"checkpoint {index.directory} has no tensor {name}")
    box = box if box is not None else tuple((0, n) for n in index.logical_shape(name))
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(n: str) -> Any:
            path = index.entries[n].file
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path]

        return _read_box(index, name, box, handle, log if log is not None else ReadLog())


def _read_box(
    index: CheckpointIndex, name: str, box: tuple[tuple[int, int], ...], handle: Any, log: ReadLog
) -> torch.Tensor:
    """The logical tensor `name` restricted to `box`, as float32 (or its stored float dtype)."""
    entries = index.entries
    if name + "_blocks" in entries and name not in entries:
        return _read_mxfp4(name, box, handle, log)
    raw = _get(handle, name, box, log)
    if name + "_scale_inv" in entries and raw.dtype == torch.float8_e4m3fn:
        (r0, r1), (c0, c1) = box
        b0, b1 = index.block_size
        sbox = ((r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1)))
        scale = _get(handle, name + "_scale_inv", sbox, log)
        return dequant_fp8_block(
            raw, scale, block=(b0, b1), offset=(r0 - sbox[0][0] * b0, c0 - sbox[1][0] * b1)
        )
    return raw


def _read_mxfp4(
    name: str, box: tuple[tuple[int, int], ...], handle: Any, log: ReadLog
) -> torch.Tensor:
    c0, c1 = box[-1]
    g0, g1 = c0 // _MXFP4_GROUP, -(-c1 // _MXFP4_GROUP)
    blocks = _get(handle, name + "_blocks", (*box[:-1], (g0, g1), (0, _MXFP4_GROUP // 2)), log)
    scales = _get(handle, name + "_scales", (*box[:-1], (g0, g1)), log)
    values = dequant_mxfp4(blocks, scales)
    return values[..., c0 - g0 * _MXFP4_GROUP : c1 - g0 * _MXFP4_GROUP]


def _get(handle: Any, name: str, box: tuple[tuple[int, int], ...], log: ReadLog) -> torch.Tensor:
    log.reads.append(Read(name=name, box=box))
    sl = handle(name).get_slice(name)
    return sl[tuple(slice(a, b) for a, b in box)]


def dequant_fp8_block(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: tuple[int, int] = (128, 128),
    offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """w [R, C] float8 e4m3 (a window of the full weight starting `offset` into its first scale
    block), scale_inv [ceil((off0+R)/b0), ceil((off1+C)/b1)] float32 -> [R, C] float32."""
    r, c = w.shape
    s = scale_inv.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w.to(torch.float32) * s[offset[0] : offset[0] + r, offset[1] : offset[1] + c]


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32].

    Each byte holds two fp4 e2m1 codes, element 2j in the low nibble and 2j+1 in the high one;
    a code is sign(1) exponent(2, bias 1) mantissa(1): exponent 0 is subnormal (0 or 0.5).
    """
    b = blocks.to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).to(torch.float32)
    exp = (codes >> 1) & 3
    man = (codes & 1).to(torch.float32)
    normal = torch.ldexp(1.0 + 0.5 * man, (exp - 1).to(torch.float32))
    mag = torch.where(exp == 0, 0.5 * man, normal)
    shift = scales.to(torch.int32) - 127
    return (sign * torch.ldexp(mag, shift[..., None].to(torch.float32))).flatten(-2)


@dataclass(frozen=True, kw_only=True)
class Completeness:
    """How the ranks' shares cover the checkpoint."""

    owners: dict[str, tuple[int, ...]]
    """Logical tensor -> ranks reading some part of it."""
    unowned: tuple[str, ...]
    """Tensors no rank reads."""
    partial: tuple[tuple[str, int], ...]
    """(tensor, elements no rank reads) for tensors read only in part."""
    ignored: tuple[str, ...]
    """Tensors the forward pass never uses (layers past num_hidden_layers, e.g. DeepSeek's MTP layer)."""

    @property
    def ok(self) -> bool:
        return not self.unowned and not self.partial

    def raise_if_incomplete(self) -> None:
        if self.unowned:
            raise CheckFailed(
                f"{len(self.unowned)} checkpoint tensors are owned by no rank, first {self.unowned[0]}"
            )
        if self.partial:
            name, missing = self.partial[0]
            raise CheckFailed(
                f"{len(self.partial)} checkpoint tensors are only partly owned, first {name} ({missing} elements unread)"
            )


def completeness(
    index: CheckpointIndex, shares_by_rank: Mapping[int, Sequence[Share]]
) -> Completeness:
    """Check every rank's shares against the checkpoint, then add up the coverage of each tensor.

    Step 1: every share must name an existing tensor of the right shape (InputError naming the rank).
    Step 2: per tensor, the union of the boxes of all ranks (coordinate-compressed, so replicated
    boxes count once) must be the whole tensor.
    """
    boxes: dict[str, list[tuple[tuple[int, int], ...]]] = {}
    owners: dict[str, set[int]] = {}
    for rank, shares in shares_by_rank.items():
        check_shares(shares, index, rank=rank)
        for s in shares:
            boxes.setdefault(s.name, []).append(s.box)
            owners.setdefault(s.name, set()).add(rank)
    num_layers = index.arch().num_layers
    ignored, unowned, partial = [], [], []
    for name in index.logical_names():
        m = _LAYER.match(name)
        if (m and int(m.group(1)) >= num_layers) or name.endswith("rotary_emb.inv_freq"):
            ignored.append(name)
        elif name not in boxes:
            unowned.append(name)
        else:
            missing = _uncovered(index.logical_shape(name), boxes[name])
            if missing:
                partial.append((name, missing))
    return Completeness(
        owners={k: tuple(sorted(v)) for k, v in owners.items()},
        unowned=tuple(unowned),
        partial=tuple(partial),
        ignored=tuple(ignored),
    )


def _uncovered(shape: tuple[int, ...], boxes: list[tuple[tuple[int, int], ...]]) -> int:
    """Elements of a tensor of `shape` outside the union of `boxes`."""
    cuts = [
        sorted({0, n, *(b[d][0] for b in boxes), *(b[d][1] for b in boxes)})
        for d, n in enumerate(shape)
    ]
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for b in boxes:
        idx = tuple(
            slice(cuts[d].index(b[d][0]), cuts[d].index(b[d][1])) for d in range(len(shape))
        )
        grid[idx] = True
    sizes = [
        torch.tensor([c[i + 1] - c[i] for i in range(len(c) - 1)], dtype=torch.int64) for c in cuts
    ]
    cell = sizes[0] if sizes else torch.ones((), dtype=torch.int64)
    for s in sizes[1:]:
        cell = cell[..., None] * s
    return int((cell * (~grid)).sum())
