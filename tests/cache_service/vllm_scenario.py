"""Runs inside the vLLM venv (`deploy/vllm_env.py`): vLLM with our connector, one JSON report.

Each run records the greedy tokens and the log-probability of each (a KV that is off by a little
shows there even when the tiny random model repeats one token).

    python tests/cache_service/vllm_scenario.py MODEL_DIR BLOCK_SIZE REDIS_URL REPORT.json
    python tests/cache_service/vllm_scenario.py --multiprocess MODEL_DIR BLOCK_SIZE REDIS_URL REPORT.json

One in-process engine without the connector gives the reference greedy tokens, then one with
`TieredKVConnector` over [host://, REDIS_URL] (a Redis the caller owns: the last phase shuts it
down) runs the phases below; each records tokens, vLLM's cached tokens for the request, the
connector's counters, our cache's stats and vLLM's `external_prefix_cache_hits` counter.

    cold        A = P + tail_a: computed, its full prompt blocks stored
    hit         B = P + tail_b: P's blocks loaded from our cache
    corrupt     P's blocks dropped from the host tier, their payload in Redis overwritten: misses
    healed      B again: the blocks vLLM recomputed were stored again, hits again
    forged      P's blocks dropped from the host tier, rewritten in Redis with the payload
                changed and the checksum recomputed (the codec's checks pass): the MAC makes
                them misses (unauthenticated), the output equals B's baseline
    noise       P's blocks replaced by validly encoded noise: the output must change (loads are used)
    restored    A again after removing the noise: computes and stores P again
    redis_down  Q's blocks only in Redis, Redis shut down: D = Q + tail computes (no hit), and B
                still hits from the host tier
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from pathlib import Path

import redis
import torch
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer import get_kv_transfer_group

from cache_service import vllm_connector
from cache_service.block_key import prefix_block_keys
from cache_service.block_mac import TAG_BYTES
from cache_service.codec import HEADER_BYTES, decode_block, encode_block, read_header


def main() -> int:
    if sys.argv[1] == "--multiprocess":
        return multiprocess(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    model, block_size, redis_url, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    prompts, p, q, rng = _prompts(model, block_size)
    common = _engine_args(model, block_size)

    def run(llm: LLM, name: str) -> dict:
        return _generate(llm, prompts[name])

    # Step 1: the reference, without the connector.
    llm = LLM(**common)
    baseline = {name: run(llm, name) for name in prompts}
    del llm

    # Step 2: the connector over host + the caller's Redis.
    transfer = KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="cache_service.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"tiers": ["host://", redis_url], "deployment": "vllm-test"},
    )
    llm = LLM(**common, kv_transfer_config=transfer)
    worker = get_kv_transfer_group()
    (cache,) = vllm_connector.open_caches()
    host, shared = cache.tiers
    client = redis.Redis.from_url(redis_url)
    p_keys = prefix_block_keys(token_ids=p, **worker._key_fields)
    q_keys = prefix_block_keys(token_ids=q, **worker._key_fields)
    report: dict = {"baseline": baseline, "prefix_tokens": len(p), "phases": {}}

    def phase(label: str, name: str) -> None:
        # vLLM's paged KV is overwritten first, so a block the connector failed to load can never
        # be served from a previous request's leftovers (its prefix cache is off, blocks reused).
        with torch.no_grad():
            for layer in worker._layers:
                layer.fill_(7.5)
        before = dict(worker.counters)
        result = run(llm, name)
        result["counters"] = {k: worker.counters[k] - before[k] for k in before}
        result["cache"] = {t["name"]: t for t in cache.stats()["tiers"]}
        result["vllm_external_hits"] = _counter(llm, "vllm:external_prefix_cache_hits")
        result["prompt"] = name
        report["phases"][label] = result

    phase("cold", "A")
    phase("hit", "B")
    # Corrupt: gone from the host tier, payload overwritten in Redis (header and checksum kept).
    host.delete(p_keys)
    for key in p_keys:
        value = client.get(shared.value_key(key))
        garbage = bytes(rng.randrange(256) for _ in range(len(value) - HEADER_BYTES))
        client.set(shared.value_key(key), value[:HEADER_BYTES] + garbage)
    phase("corrupt", "B")
    phase("healed", "B")
    # Forged: a writer without the secret rewrites the blocks with a valid checksum.
    host.delete(p_keys)
    for key in p_keys:
        value = client.get(shared.value_key(key))
        block, tag = value[:-TAG_BYTES], value[-TAG_BYTES:]
        head = read_header(block)
        forged = encode_block(
            -3 * decode_block(block, expected_key=key), key=key, codec=head.codec,
            compression=head.compression, checksum=head.checksum_kind,
        )  # fmt: skip
        client.set(shared.value_key(key), bytes(forged) + tag)
    phase("forged", "B")
    # Noise: valid blocks (right key, right checksum) holding the wrong KV.
    shape = (len(worker._layers), *worker._layers[0].shape[1:])
    host.delete(p_keys)
    shared.delete(p_keys)
    gen = torch.Generator().manual_seed(0)
    noise = [
        (k, encode_block(3 * torch.randn(shape, generator=gen), key=k, codec="raw")) for k in p_keys
    ]
    cache.put_many(noise)
    phase("noise", "B")
    cache.evict(p_keys)
    phase("restored", "A")
    # Redis goes away: Q's blocks live only there.
    phase("q_cold", "Q")
    host.delete(q_keys)
    with contextlib.suppress(redis.exceptions.ConnectionError):  # it closes as it exits
        client.execute_command("SHUTDOWN", "NOSAVE")
    phase("redis_down", "D")
    phase("host_after_redis_down", "B")
    report["redis_available_at_end"] = shared.available()
    with open(out_path, "w") as handle:
        json.dump(report, handle)
    return 0


def multiprocess(model: str, block_size: int, redis_url: str, out_path: str) -> int:
    """vLLM's default engine: the scheduler side (EngineCore process) and the worker side (a worker
    process) share nothing but Redis. B computes cold and stores P; A then hits P; B again hits P
    and must equal its cold run."""
    prompts, _, _, _ = _prompts(model, block_size)
    transfer = KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="cache_service.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"tiers": ["host://", redis_url], "deployment": "vllm-mp"},
    )
    llm = LLM(**_engine_args(model, block_size), kv_transfer_config=transfer)
    report = {}
    for label, name in (("B_cold", "B"), ("A_hit", "A"), ("B_hit", "B")):
        report[label] = _generate(llm, prompts[name])
        report[label]["vllm_external_hits"] = _counter(llm, "vllm:external_prefix_cache_hits")
    report["prefix_tokens"] = 4 * block_size
    with open(out_path, "w") as handle:
        json.dump(report, handle)
    return 0


def _prompts(
    model: str, block_size: int
) -> tuple[dict[str, list[int]], list[int], list[int], random.Random]:
    """A and B share the 4-block prefix P, D and Q share Q; tails differ."""
    rng = random.Random(7)
    with open(os.path.join(model, "config.json")) as handle:
        vocab = json.load(handle)["vocab_size"]
    p = [rng.randrange(vocab) for _ in range(4 * block_size)]
    q = [rng.randrange(vocab) for _ in range(4 * block_size)]
    prompts = {
        "A": p + [rng.randrange(vocab) for _ in range(9)],
        "B": p + [rng.randrange(vocab) for _ in range(11)],
        "D": q + [rng.randrange(vocab) for _ in range(5)],
        "Q": q + [rng.randrange(vocab) for _ in range(7)],
    }
    return prompts, p, q, rng


def _engine_args(model: str, block_size: int) -> dict:
    extra = {}
    if "kv_lora_rank" in json.loads((Path(model) / "config.json").read_text()):
        # MLA in float32: vLLM's reference CPU MLA backend. Where the CPU has AMX, vLLM picks its
        # AMX MLA backend instead, which takes 16-bit/8-bit weights only.
        extra["attention_config"] = {"backend": "CPU_MLA"}
    return {
        **extra,
        "model": model,
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": block_size,
        "max_model_len": 256,
        "enable_prefix_caching": False,  # every reused token comes from the connector
        "max_num_seqs": 4,
        "disable_log_stats": False,
    }


def _generate(llm: LLM, prompt: list[int]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    logprobs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
    return {"tokens": tokens, "logprobs": logprobs, "cached": out.num_cached_tokens or 0}


def _counter(llm: LLM, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


if __name__ == "__main__":
    sys.exit(main())
