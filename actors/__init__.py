"""The runtime: engine, runners, workers, layers and kernels.

On import, `THP_MEM_ALLOC_ENABLE=1` (unless set) asks torch's CPU allocator to back each
allocation of 2 MB or more (KV cache, stacked expert weights, a prefill's activations) with
transparent huge pages. torch reads it once, at the process's first CPU allocation, so it takes
effect in processes that import `actors` before allocating tensors (ours: moectl, the Ray
workers, the benches). On a VM a 4 KB page's TLB miss is a two-level page walk: a 2,000-token
prefix hit read its 4 MB of scattered K/V blocks at ~2 GB/s (bench/notes/cpu_engine_speed.md).
`THP_MEM_ALLOC_ENABLE=0` keeps 4 KB pages.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
