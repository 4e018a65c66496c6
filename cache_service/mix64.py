"""MIX64: a 64-bit checksum written in torch ops, so the CPU and a GPU compute the same value.

Each 64-bit word w at position i (counted from the start of what is checksummed) is mixed as
x = (w + (i + 1) P) M1; x ^= x >> 32 (logical); x *= M2 (all modulo 2^64), and the checksum is
the sum of the mixed words modulo 2^64. Sums of disjoint position ranges add up to the whole's,
so a header and a payload can be summed apart (on different devices). It detects corruption; it
is no defence against someone who can write the tier (nor is XXH3). The block header that
carries it is cache_service/codec.py's.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

MIX_P = 0x9E3779B97F4A7C15
MIX_M1 = 0xBF58476D1CE4E5B9
MIX_M2 = 0x94D049BB133111EB


def mix64(words: torch.Tensor, *, first: int = 0) -> torch.Tensor:
    """MIX64 of each row of `words` (any device; see the module docstring).

    words: [..., W] int64, the words at positions first .. first + W - 1 of the checksummed
    bytes. Returns [...] int64: the sum over the last dim of the mixed words, modulo 2^64. Sums
    of disjoint position ranges add (modulo 2^64) to the sum of the whole, so a header and a
    payload can be summed on different devices. Memory: one temporary the size of `words`
    (and one of its shifted copy). A small CPU input (at most NUMPY_WORDS words: the header
    words of a store piece, summed on the host per piece) goes through numpy, whose per-call
    cost is a fraction of torch's on such sizes; the arithmetic is the same (uint64, wrapping).
    """
    if words.device.type == "cpu" and words.numel() <= NUMPY_WORDS:
        return _mix64_numpy(words, first)
    x = words + _positions(first, words.shape[-1], words.device)
    x.mul_(_signed(MIX_M1))
    shifted = x >> 32  # arithmetic on int64; the mask makes it a logical shift
    shifted.bitwise_and_(0xFFFFFFFF)
    x.bitwise_xor_(shifted)
    del shifted
    x.mul_(_signed(MIX_M2))
    return x.sum(dim=-1)


NUMPY_WORDS = 1 << 14
"""CPU inputs up to this many words are summed with numpy (see `mix64`)."""


def _mix64_numpy(words: torch.Tensor, first: int) -> torch.Tensor:
    """`mix64` in numpy uint64 arithmetic (wraps modulo 2^64, as torch's int64 does)."""
    w = words.numpy().view(np.uint64)  # any strides (the header columns of rows, say)
    with np.errstate(over="ignore"):
        x = w + _positions_numpy(first, w.shape[-1])
        x *= np.uint64(MIX_M1)
        x ^= x >> np.uint64(32)
        x *= np.uint64(MIX_M2)
        total = x.sum(axis=-1, dtype=np.uint64)
    return torch.from_numpy(np.array(total, dtype=np.uint64).view(np.int64))


_POSITIONS_NUMPY: dict[tuple[int, int], np.ndarray] = {}


def _positions_numpy(first: int, count: int) -> np.ndarray:
    """(i + 1) * P modulo 2^64 for i in first .. first + count - 1: [count] uint64 (cached)."""
    table = _POSITIONS_NUMPY.get((first, count))
    if table is None:
        with np.errstate(over="ignore"):
            table = np.arange(first + 1, first + count + 1, dtype=np.uint64) * np.uint64(MIX_P)
        with _POSITIONS_LOCK:
            while len(_POSITIONS_NUMPY) >= 8:
                _POSITIONS_NUMPY.pop(next(iter(_POSITIONS_NUMPY)))
            _POSITIONS_NUMPY[(first, count)] = table
    return table


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_POSITIONS: dict[tuple[int, int, str], torch.Tensor] = {}
_POSITIONS_LOCK = threading.Lock()


def _positions(first: int, count: int, device: torch.device) -> torch.Tensor:
    """(i + 1) * P modulo 2^64 for i in first .. first + count - 1: [count] int64 on `device`
    (computed on the CPU, cached for the last few shapes)."""
    key = (first, count, str(device))
    with _POSITIONS_LOCK:
        table = _POSITIONS.get(key)
    if table is None:
        table = torch.arange(first + 1, first + count + 1, dtype=torch.int64)
        table = table.mul_(_signed(MIX_P)).to(device)
        with _POSITIONS_LOCK:
            while len(_POSITIONS) >= 8:
                _POSITIONS.pop(next(iter(_POSITIONS)))
            _POSITIONS[key] = table
    return table


def mix64_bytes(head: bytes | memoryview, body: bytes | memoryview) -> int:
    """MIX64 (CPU) of the header's first 80 bytes followed by the body, zero-padded to words."""
    size = len(head) + len(body)
    buf = np.zeros(-(-size // 8) * 8, dtype=np.uint8)
    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    buf[len(head) : size] = np.frombuffer(body, dtype=np.uint8)
    return int(mix64(torch.from_numpy(buf.view(np.int64))))
