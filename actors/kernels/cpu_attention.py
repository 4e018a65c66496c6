"""Decode attention on the CPU in C, reading the paged cache in place (issue 13).

A decode step's attention on the CPU went through SDPA's flash kernel after gathering every
context into a padded copy: ~0.85 ms a layer of the tiny checkpoint's batch-64 step (64 x 2 KV
heads x 4 query rows over ~170 keys of 32) on a 2-core AMD EPYC, where vLLM's C++ kernel, which
reads its paged cache, takes ~0.35. `cpu_decode_attention.c` is such a kernel: a task a
sequence, each cache block read as one contiguous span, the scores of 16 keys summed at once
(AVX-512) and the rest vectorised by the compiler for this CPU: ~0.45 ms in the same step
(BENCHMARKS.md, twelfth session).

It is compiled at first use (`cc -O3 -march=native -ffast-math -fopenmp`, ~0.3 s) into
`$MOE_KERNEL_CACHE` (default ~/.cache/moe-orchestrator/cpu-kernels), keyed by the source, the
flags, the compiler and this CPU's flags, and loaded through ctypes. Its OpenMP runtime is the
libgomp torch has loaded (the same SONAME), so it runs on torch's threads. Where there is no
compiler, or `MOE_CPU_ATTENTION_KERNEL=0`, `decode_attention` returns None and the caller keeps
SDPA. Each sequence's result depends on its own inputs only (not on the batch, the thread count
or the padding), so it is batch invariant; it differs from SDPA's within float32 reordering.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
"""Compile flags. The link step leaves out -ffast-math: linked with it, gcc adds crtfastmath,
whose constructor turns on flush-to-zero for the whole process when the library loads."""
LIBS = (("-lmvec", "-lm"), ("-lm",))  # libmvec holds the vectorised expf; not on every libc
ENABLED = [os.environ.get("MOE_CPU_ATTENTION_KERNEL", "1") != "0"]
"""Switch of the kernel (tests and A/B benches flip it; the environment variable sets it)."""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr] * 6 + [_i64] * 7 + [ctypes.c_float] + [_i64] * 4 + [ctypes.c_int]


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "moe-orchestrator" / "cpu-kernels"
    return Path(os.environ.get("MOE_KERNEL_CACHE", default)).expanduser()


def _cpu_flags() -> str:
    """This CPU's feature flags (-march=native builds for them: a cache shared by machines of
    other CPUs must not load a library built for this one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source, flags, compiler and CPU), or None where it
    cannot be built or loaded (logged once)."""
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: CPU decode attention stays on SDPA")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        ident = [
            SOURCE.read_bytes().hex(),
            *FLAGS,
            str(LIBS),
            version.stdout,
            _cpu_flags(),
            platform.machine(),
        ]
        key = hashlib.sha256("\0".join(ident).encode()).hexdigest()[:16]
        target = cache_dir() / f"decode_attention-{key}.so"
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU decode attention kernel unavailable (%s): SDPA is used", e)
        return None
    lib.moe_decode_attention.argtypes = _ARGTYPES
    lib.moe_decode_attention.restype = ctypes.c_int
    return lib


def _build(cc: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename (concurrent builders race
    harmlessly: each rename puts a whole library in place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so", dir=target.parent)
    os.close(fd)
    obj = f"{tmp}.o"
    try:
        done = _run([cc, *FLAGS, "-c", "-o", obj, str(SOURCE)])
        if done.returncode == 0:
            for libs in LIBS:
                done = _run([cc, "-shared", "-fopenmp", "-o", tmp, obj, *libs])
                if done.returncode == 0:
                    os.replace(tmp, target)
                    return
        raise OSError(f"{cc} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    finally:
        Path(tmp).unlink(missing_ok=True)
        Path(obj).unlink(missing_ok=True)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def serves(k_cache: torch.Tensor, v_cache: torch.Tensor | None) -> bool:
    """Whether decode steps over this cache layer run the kernel: switched on, built here, and
    float32 CPU K and V [blocks, block_size, KV, D] with each token's heads contiguous."""
    if not ENABLED[0] or v_cache is None or k_cache.device.type != "cpu":
        return False
    if any(t.dtype != torch.float32 or t.dim() != 4 for t in (k_cache, v_cache)):
        return False
    if any(t.stride(3) != 1 or t.stride(2) != t.shape[3] for t in (k_cache, v_cache)):
        return False
    return v_cache.shape[:3] == k_cache.shape[:3] and library() is not None


def suits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None) -> bool:
    """`serves`, and q [B, H, D] float32 of the cache's head size, H a multiple of KV."""
    if q.dtype != torch.float32 or q.dim() != 3 or q.requires_grad or q.device.type != "cpu":
        return False
    ok = q.shape[2] == k_cache.shape[-1] and q.shape[1] % k_cache.shape[2] == 0
    return ok and serves(k_cache, v_cache)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one new token per sequence over its cached context, q [B, H, D] -> [B, H, Dv].

    k_cache [blocks, block_size, KV, D], v_cache [blocks, block_size, KV, Dv] (one layer of the
    paged cache); table [B, >= ceil(max(lens) / block_size)] int64 block ids (rows padded with
    anything: slots past a sequence's length are not read); lens [B] int64, each >= 1. None when
    the kernel does not apply (not `suits`, or not built here): the caller uses SDPA."""
    if not suits(q, k_cache, v_cache):
        return None
    lib = library()
    b, h, d = q.shape
    bs, kv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    table = table.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    if table.shape[0] != b or lens.shape != (b,) or b == 0:
        raise ValueError(
            f"decode attention: table {tuple(table.shape)}, lens {tuple(lens.shape)} for {b} queries"
        )
    low, high = int(lens.min()), int(lens.max())
    if low < 1 or high > table.shape[1] * bs:
        raise ValueError(
            f"decode attention: context lengths {low}..{high} outside 1..{table.shape[1] * bs}"
        )
    if int(table.min()) < 0 or int(table.max()) >= k_cache.shape[0]:  # padding slots included
        raise ValueError(f"decode attention: block ids outside 0..{k_cache.shape[0] - 1}")
    q = q.contiguous()
    out = q.new_empty(b, h, dv)
    rc = lib.moe_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(),
        out.data_ptr(), b, h, kv, d, dv, bs, table.shape[1], scale,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("decode attention: no memory for the kernel's scratch rows")
    return out
