"""Linear-attention hybrids served by our engine on the GPU against transformers' own model, one
device call (issue 38):

    python3 bench/hybrid_gpu.py --out $OUT/hybrid_gpu.json          # ~4 min; --tiny: CPU

Models: Qwen3-Next-80B-A3B's and Kimi-Linear-48B-A3B's full widths (transformers' default
configs of `qwen3_next` and `kimi_linear`) cut to 4 layers, 3 linear-attention (gated DeltaNet /
KDA) and 1 full attention, random bf16 weights (transformers' own init, seed 0), saved as a
checkpoint. Ours: `build_engine(ckpt, device="cuda")` (the generic path: transformers' modules
over our paged cache, state slots, our delta rule). Theirs: the same weights in
`AutoModelForCausalLM` with its own cache (its torch linear attention: no flash-linear-attention
on that machine), greedy.
- decode: batch 1 and 32, prompts of 128 tokens, the median step once every sequence decodes;
- prefill: one 8,192-token prompt to its first token (ours: two steps, the chunk cut at the last
  block boundary before the last token for the state snapshot; theirs: one forward).
Bounds: decode = bytes a step must read (the non-expert weights, the experts the batch can hit
in expectation, the state read and written, the KV) at the measured copy rate; prefill = 2 x
active parameters x tokens + attention FLOPs at the measured bf16 matrix rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LAYERS = {"qwen3_next": ["linear_attention"] * 3 + ["full_attention"],
          "kimi_linear": ["linear_attention"] * 3 + ["full_attention"]}  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, vocab_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_heads=4, linear_head_dim=16, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
            shared_expert_intermediate_size=32)  # fmt: skip


VOCAB = [1000]
"""Prompt ids are drawn below min(1000, this): the vocabulary of the model being run."""


def config(model_type: str, tiny: bool):
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    over = {"num_hidden_layers": 4, "layer_types": LAYERS[model_type]}
    if tiny:
        over |= {k: v for k, v in TINY.items() if k in cfg.to_dict()}
        over |= {k: None for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    lac = cfg.to_dict().get("linear_attn_config")
    if isinstance(lac, dict):  # kimi_linear before transformers 5.2x: kinds there, 1-based
        lac = dict(lac, kda_layers=[1, 2, 3], full_attn_layers=[4])
        over["linear_attn_config"] = lac | ({"num_heads": 4, "head_dim": 16} if tiny else {})
    kinds = cfg.to_dict().get("mlp_layer_types")
    if isinstance(kinds, list):
        over["mlp_layer_types"] = kinds[:4]
    for k, v in over.items():
        setattr(cfg, k, v)
    if getattr(cfg, "kv_lora_rank", None):  # MLA: a key and value per query head
        cfg.num_key_value_heads = cfg.num_attention_heads
    VOCAB[0] = cfg.vocab_size
    return cfg


def write_checkpoint(cfg, path: Path, device: str):
    """Random bf16 weights and a word-level tokenizer over the vocabulary; returns the model."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return model


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ours(path: Path, device: str, prompt_len: int, long_len: int) -> dict:
    from actors.engine.factory import build_engine
    from actors.engine.sampler import SamplingParams

    out = {}
    engine = build_engine(path, device=device, dtype="bfloat16", cache_key_secret=b"bench",
                          num_blocks=(long_len // 16) + 64 * 16, block_size=16,
                          max_num_batched_tokens=long_len + 64, max_num_seqs=32,
                          batch_invariant=False)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for batch in (1, 32):
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        for i in range(batch):
            ids = torch.randint(3, min(1000, VOCAB[0]), (prompt_len,), generator=g).tolist()
            engine.add_request(f"d{batch}-{i}", ids, params)
        times = []
        while engine.has_unfinished():
            decoding = all(s.num_computed >= s.num_tokens - 1 for s in engine.seqs.values())
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            if decoding and len(engine.seqs) == batch:
                times.append((time.perf_counter() - t0) * 1e3)
        out[f"decode_b{batch}_ms"] = statistics.median(times[2:]) if len(times) > 2 else None
    ids = torch.randint(3, min(1000, VOCAB[0]), (long_len,), generator=g).tolist()
    for rep in range(2):  # the first also compiles and grows the state pool
        engine.add_request(f"long{rep}", ids if rep else ids[::-1], SamplingParams(max_tokens=1))
        sync(device)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(device)
        out["prefill_ms"] = (time.perf_counter() - t0) * 1e3
    out["stats"] = {k: engine.stats().get(k) for k in ("steps", "state_saves", "prefix_hits")}
    return out


def theirs(model, device: str, prompt_len: int, long_len: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch in (1, 32):
            ids = torch.randint(3, min(1000, VOCAB[0]), (batch, prompt_len), generator=g).to(device)
            res = model(ids, use_cache=True)
            cache, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(24):
                sync(device)
                t0 = time.perf_counter()
                res = model(nxt, past_key_values=cache, use_cache=True)
                sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
                cache, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)
            out[f"decode_b{batch}_ms"] = statistics.median(times[2:])
        ids = torch.randint(3, min(1000, VOCAB[0]), (1, long_len), generator=g).to(device)
        for _ in range(2):
            sync(device)
            t0 = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            sync(device)
            out["prefill_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def bounds(cfg, device: str, prompt_len: int, long_len: int, ceilings: dict) -> dict:
    """The bytes and FLOPs bounds of the module docstring."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    expert_bytes, other_bytes, experts_per_layer = 0, 0, 1
    for name, p in meta.named_parameters():
        if ".experts." in name:
            expert_bytes += p.numel() * 2
            experts_per_layer = max(experts_per_layer, p.shape[0] if p.dim() == 3 else 1)
        else:
            other_bytes += p.numel() * 2
    e, k = experts_per_layer, int(getattr(cfg, "num_experts_per_tok", 1) or 1)
    linear = sum(t == "linear_attention" for t in LAYERS[cfg.model_type])
    if cfg.model_type == "qwen3_next":
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        kv = 2 * cfg.num_key_value_heads * cfg.head_dim
    else:
        lac = cfg.to_dict().get("linear_attn_config") or {}
        heads = lac.get("num_heads") or cfg.to_dict().get("linear_num_heads")
        state = heads * (lac.get("head_dim") or cfg.to_dict().get("linear_head_dim")) ** 2
        kv = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    out = {}
    for batch in (1, 32):
        hit = e * (1 - (1 - k / e) ** batch) / e  # expected share of a layer's experts touched
        moved = (
            other_bytes
            + hit * expert_bytes
            + batch * (linear * state * 4 * 2 + prompt_len * kv * 2)
        )
        out[f"decode_b{batch}_bound_ms"] = moved / (ceilings["copy_GBps"] * 1e6)
    active = other_bytes / 2 + (k / e) * expert_bytes / 2
    flops = 2 * active * long_len
    out["prefill_bound_ms"] = flops / (ceilings["bf16_TFLOPs"] * 1e9)
    return out


def ceilings(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"copy_GBps": 20.0, "bf16_TFLOPs": 0.5}
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for f in (lambda: y.copy_(x), lambda: a @ a):
        f()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    copy = 2 * x.numel() * 10 / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    sync(device)
    mm = 2 * 8192**3 * 10 / (time.perf_counter() - t0) / 1e12
    return {"copy_GBps": copy, "bf16_TFLOPs": mm}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (a dry run)")
    p.add_argument("--work", type=Path, default=Path("/tmp/hybrid_gpu"))
    opts = p.parse_args()
    device = "cpu" if opts.tiny else "cuda"
    prompt_len, long_len = (32, 256) if opts.tiny else (128, 8192)
    import transformers

    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    report["ceilings"] = lim = ceilings(device)
    for model_type in LAYERS:
        cfg = config(model_type, opts.tiny)
        path = opts.work / model_type
        model = write_checkpoint(cfg, path, device)
        row = {"theirs": theirs(model, device, prompt_len, long_len)}
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        row["ours"] = ours(path, device, prompt_len, long_len)
        row["bounds"] = bounds(cfg, device, prompt_len, long_len, lim)
        report[model_type] = row
        print(model_type, json.dumps(row), flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
