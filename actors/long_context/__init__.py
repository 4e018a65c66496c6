"""Attention over a context longer than the device holds: KV blocks on device, host, Redis, disk.

Modules: `block_source` (where blocks are read from), `block_attention` (exact online-softmax
attention streamed block by block, with a prefetching reader), `sparse` (block summaries, the
score bound, block selection, attention-mass feedback), `sequence_kv` (one sequence's KV under a
device budget, sealed blocks written down the tiers), `prefill` (chunked prefill), `long_model`
(a StageModel run over that KV), `sweep` and `cli` (`moectl bench long-context`).

Torch-only at import time: the tiers are reached through an injected cache object.
"""
