"""The StageModel over tiered KV: exact mode equals the dense model; prefill device KV is bounded."""

from __future__ import annotations

import uuid

import pytest
import torch

from actors.bench.long_context_sweep import block_bytes
from actors.long_context.long_model import LongContextModel
from actors.long_context.prefill import chunked_prefill
from actors.long_context.sequence_kv import KeyContext, SequenceKV
from actors.long_context.sparse import AttentionConfig
from actors.model.arch import ArchConfig
from actors.model.stage import StageModel, positions_for
from cache_service.namespace import CacheNamespace
from cache_service.store import TieredCache
from cluster.errors import InputError
from tests.actors.checkpoints import _COMMON, _DEFAULTS

B = 8


def _stage(family: str, seed: int = 0, **overrides) -> StageModel:
    cfg = {
        **_COMMON,
        **_DEFAULTS[family],
        "model_type": family,
        "num_hidden_layers": 2,
        **overrides,
    }
    arch = ArchConfig.from_hf(cfg, source="test")
    torch.manual_seed(seed)
    stage = StageModel(arch, layer_range=(0, arch.num_layers), first=True, last=True)
    with torch.no_grad():  # larger projections than the default init: peaked attention
        for name, param in stage.named_parameters():
            if "proj" in name:
                param.mul_(3.0)
    return stage


def _cache(tmp_path, **kwargs) -> TieredCache:
    ns = CacheNamespace(model_fingerprint=f"fp-{uuid.uuid4().hex}", deployment="lc-test")
    return TieredCache.from_urls(
        ["host://", f"file://{tmp_path}/kv"], capacities=[20_000, 1 << 30], namespace=ns, **kwargs
    )


def _kv(
    stage, cache, *, budget_blocks: int, sinks: int, window: int, layers=(0, 1), block: int = B
) -> SequenceKV:
    per_block = block_bytes(stage.arch, block, torch.float32)
    return SequenceKV(
        layers=list(layers),
        block_size=block,
        cache=cache,
        key_context=KeyContext(secret=b"t", weights_fingerprint="test", kv_dtype="float32"),
        device_budget_bytes=budget_blocks * per_block * len(layers),
        sink_blocks=sinks,
        window_blocks=window,
        block_bytes=per_block,
    )


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_exact_mode_over_tiers_equals_the_dense_model(family, tmp_path):
    """Chunked prefill with most blocks in host/disk, then decode: logits == StageModel.forward."""
    stage = _stage(family)
    vocab = stage.arch.vocab_size
    ids = torch.randint(0, vocab, (103,), generator=torch.Generator().manual_seed(1))
    config = AttentionConfig(mode="exact", block_size=B, sink_blocks=1, window_blocks=2)
    with _cache(tmp_path) as cache:
        kv = _kv(stage, cache, budget_blocks=4, sinks=1, window=2)
        model = LongContextModel(stage, config, batch_blocks=3)
        result = chunked_prefill(model, ids[:100], kv, chunk_tokens=4 * B)
        assert kv.offloaded_blocks > 10 and kv.tier_reads["blocks"] > 0
        dense = stage(ids[:100], positions_for([100]), [100])[-1]
        assert _rel(result.logits, dense) < 1e-4
        for pos in range(100, 103):
            logits = model.forward(ids[pos : pos + 1], pos, kv)
            kv.offload()
        dense = stage(ids, positions_for([103]), [103])[-1]
        assert _rel(logits, dense) < 1e-4


def test_chunked_prefill_device_kv_is_bounded_whatever_the_length(tmp_path):
    block = 16
    # One dense layer, small widths, 16-token blocks: the test is about memory, not the model.
    stage = _stage(
        "qwen3_moe",
        hidden_size=32,
        num_attention_heads=2,
        head_dim=16,
        num_key_value_heads=1,
        num_hidden_layers=1,
        mlp_only_layers=[0],
    )
    config = AttentionConfig(
        mode="sparse", block_size=block, sink_blocks=1, window_blocks=4, top_k=4
    )
    per_block = block_bytes(stage.arch, block, torch.float32)
    chunk = 64 * block
    peaks, summaries = {}, {}
    for length in (8 * 1024, 64 * 1024):
        ids = torch.randint(
            0, stage.arch.vocab_size, (length,), generator=torch.Generator().manual_seed(2)
        )
        with _cache(tmp_path / str(length)) as cache:
            kv = _kv(stage, cache, budget_blocks=16, sinks=1, window=4, layers=(0,), block=block)
            result = chunked_prefill(LongContextModel(stage, config), ids, kv, chunk_tokens=chunk)
            blocks = length // block
            assert result.offloaded_blocks == blocks - 16
            assert all(cache.contains(kv.keys(0)[1 : blocks - 16]))
            peaks[length] = result.peak_device_kv_bytes
            summaries[length] = result.summary_bytes
    # Budget (16 blocks) + one chunk of KV per layer at most, and the same at both lengths.
    assert peaks[64 * 1024] <= 16 * per_block + chunk // block * per_block
    assert abs(peaks[64 * 1024] - peaks[8 * 1024]) <= 0.02 * peaks[8 * 1024]
    # Summaries: min and max of 1 KV head x 16 dims, float32, per block of the one layer.
    for length, size in summaries.items():
        assert size == 2 * (length // block) * 1 * 16 * 4


def test_bad_settings_are_input_errors(tmp_path):
    stage = _stage("qwen3_moe")
    with _cache(tmp_path) as cache:
        with pytest.raises(InputError, match="device budget"):
            _kv(stage, cache, budget_blocks=2, sinks=1, window=4)
        kv = _kv(stage, cache, budget_blocks=16, sinks=1, window=2)
        model = LongContextModel(stage, AttentionConfig(block_size=B))
        with pytest.raises(InputError, match="chunk_tokens=12"):
            chunked_prefill(model, torch.arange(40), kv, chunk_tokens=12)
