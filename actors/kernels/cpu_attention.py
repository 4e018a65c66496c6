"""Attention on the CPU in C, reading the paged cache in place.

Through SDPA's flash kernel, a decode step's attention on the CPU first gathers every context
into a padded copy: ~0.85 ms a layer of the tiny checkpoint's batch-64 step (64 x 2 KV
heads x 4 query rows over ~170 keys of 32) on a 2-core AMD EPYC, where vLLM's C++ kernel, which
reads its paged cache, takes ~0.35. `cpu_paged_attention.c` is such a kernel: the new tokens of
each sequence (a decode token, a prompt chunk, a chunk after a prefix hit: any mix in one call),
a task up to 16 new tokens of a sequence, each cache block read as one contiguous span, causal
tiles of keys skipped, the scores of 16 keys summed at once (AVX-512) and the rest vectorised by
the compiler for this CPU, each group of 4 query rows' sums of p V kept in registers, a short
context's K and V prefetched towards L2 as its task starts (in a real step the other layers
have pushed them out of cache): ~0.36 ms a layer in the same decode step, ~0.18 with a warm
cache (docs/performance.md).

It is compiled at first use (`cc -O3 -march=native -ffast-math -fopenmp`, ~0.3 s) into
`$MOE_KERNEL_CACHE` (default ~/.cache/moe-orchestrator/cpu-kernels), keyed by the source, the
flags, the compiler and this CPU's flags, and loaded through ctypes. Its OpenMP runtime is the
libgomp torch has loaded (the same SONAME), so it runs on torch's threads. Where there is no
compiler, or `MOE_CPU_ATTENTION_KERNEL=0`, `paged_attention` returns None and the caller keeps
SDPA. Each token's result depends on its own inputs only (not on the batch, the thread count or
the padding), so it is batch invariant; it differs from SDPA's within float32 reordering. The
softmax is exact over a row's whole context (scratch of 16 x heads x context floats a task),
so contexts past `MAX_SCRATCH` go to SDPA's flash kernel.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
"""Compile flags. The link step leaves out -ffast-math: linked with it, gcc adds crtfastmath,
whose constructor turns on flush-to-zero for the whole process when the library loads."""
LIBS = (("-lmvec", "-lm"), ("-lm",))  # libmvec holds the vectorised expf; not on every libc
ENABLED = [os.environ.get("MOE_CPU_ATTENTION_KERNEL", "1") != "0"]
"""Whether steps may use the kernel. `MOE_CPU_ATTENTION_KERNEL=0` keeps every CPU attention on
SDPA: for a host that must not compile and load native code at run time, or a CPU without
AVX-512, where only the compiler-vectorised loops are built and the kernel has not been timed
against SDPA. Tests set it to run SDPA's path (the one MLA, sliding windows and machines without
a compiler take)."""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr] * 8 + [_i64] * 7 + [ctypes.c_float] + [_i64] * 4 + [ctypes.c_int]
QCHUNK = 16  # new tokens of a sequence a task (cpu_paged_attention.c's QCHUNK)
PROMPT_CONTEXT_MAX = [2048]
"""Longest context of a prompt chunk (2+ new tokens) a step may hold for the engine to use the
kernel (decode tokens: any). Past it SDPA's flash kernel, whose GEMM tiles suit long causal
problems, is faster on a 2-core AMD EPYC (8 heads of 32, a layer: a fresh 4,000-token prompt
68 ms vs 80; 2,000 tokens 19 vs 20, 1,536 12 vs 12); below it the kernel is (1,024 tokens 5.2
vs 5.9 ms, 512 1.5 vs 2.7, 64 prompts of 128 7.2 vs 16, 256 new tokens after 1,024 cached 3.5
vs 4.1)."""
MAX_SCRATCH = 1 << 25
"""Most floats of one task's scores (16 tokens x query heads x context): ~128 MiB a thread;
longer contexts use SDPA's flash kernel."""


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
        log.info("no C compiler: CPU attention stays on SDPA")
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
        target = cache_dir() / f"paged_attention-{key}.so"
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU paged attention kernel unavailable (%s): SDPA is used", e)
        return None
    lib.moe_paged_attention.argtypes = _ARGTYPES
    lib.moe_paged_attention.restype = ctypes.c_int
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
    """Whether steps over this cache layer run the kernel: switched on, built here, and
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


@dataclass(frozen=True)
class Seqs:
    """One call's sequences as the kernel reads them, checked once (a step's layers share them):
    `table` [B, T] int64 block ids (rows padded with any valid id: slots past what a token may
    see are not read), `lens` [B] context lengths including the new tokens, `nq` [B] new tokens
    (1 <= nq <= lens), `qstart` [B] each sequence's first row of q."""

    table: torch.Tensor
    lens: torch.Tensor
    nq: torch.Tensor
    qstart: torch.Tensor
    tokens: int
    longest: int
    block_size: int
    num_blocks: int

    @classmethod
    def of(cls, table, lens, nq, *, block_size: int, num_blocks: int) -> Seqs:
        """Checked copies (ValueError naming what is wrong, before the kernel reads anything)."""
        table = torch.as_tensor(table, dtype=torch.int64).contiguous()
        lens = torch.as_tensor(lens, dtype=torch.int64).contiguous()
        nq = torch.as_tensor(nq, dtype=torch.int64).contiguous()
        b = lens.shape[0] if lens.dim() == 1 else 0
        if b < 1 or table.dim() != 2 or table.shape[0] != b or nq.shape != (b,):
            raise ValueError(
                f"paged attention: table {tuple(table.shape)}, lens {tuple(lens.shape)} and new "
                f"tokens {tuple(nq.shape)} must describe the same B >= 1 sequences"
            )
        low, high = int(lens.min()), int(lens.max())
        if low < 1 or high > table.shape[1] * block_size:
            raise ValueError(
                f"paged attention: context lengths {low}..{high} outside "
                f"1..{table.shape[1] * block_size}"
            )
        if int(nq.min()) < 1 or bool((nq > lens).any()):
            raise ValueError("paged attention: each sequence needs 1 <= new tokens <= its length")
        if int(table.min()) < 0 or int(table.max()) >= num_blocks:  # padding slots included
            raise ValueError(f"paged attention: block ids outside 0..{num_blocks - 1}")
        qstart = torch.cumsum(nq, 0) - nq
        return cls(table, lens, nq, qstart, int(nq.sum()), high, block_size, num_blocks)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one new token per sequence over its cached context, q [B, H, D] -> [B, H, Dv]
    (`paged_attention` with one new token each)."""
    ones = torch.ones(q.shape[0], dtype=torch.int64)
    seqs = Seqs.of(table, lens, ones, block_size=k_cache.shape[1], num_blocks=k_cache.shape[0])
    return paged_attention(q, k_cache, v_cache, seqs, scale)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: Seqs, scale: float
) -> torch.Tensor | None:
    """Causal attention of each sequence's new tokens over its cached context, q [N, H, D] ->
    [N, H, Dv]: sequence b's nq[b] tokens are q's rows from qstart[b], in order, and its token j
    (0-based) sees keys 0 .. lens[b] - nq[b] + j (their K and V already written).

    k_cache [blocks, block_size, KV, D], v_cache [blocks, block_size, KV, Dv]: one layer of the
    paged cache that `seqs` was checked against. None when the kernel does not apply (not
    `suits`, not built here, or a context past `MAX_SCRATCH`): the caller uses SDPA."""
    if not suits(q, k_cache, v_cache):
        return None
    n, h, d = q.shape
    bs, kv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if n != seqs.tokens or bs != seqs.block_size or k_cache.shape[0] < seqs.num_blocks:
        raise ValueError(
            f"paged attention: {n} queries over blocks of {bs} for sequences of {seqs.tokens} new "
            f"tokens checked against blocks of {seqs.block_size}"
        )
    if QCHUNK * h * seqs.longest > MAX_SCRATCH:
        return None
    q = q.contiguous()
    out = q.new_empty(n, h, dv)
    rc = library().moe_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), seqs.table.data_ptr(),
        seqs.lens.data_ptr(), seqs.nq.data_ptr(), seqs.qstart.data_ptr(), out.data_ptr(),
        seqs.lens.shape[0], h, kv, d, dv, bs, seqs.table.shape[1], scale, k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged attention: no memory for the kernel's scratch rows")
    return out
