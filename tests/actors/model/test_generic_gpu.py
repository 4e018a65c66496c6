"""On a CUDA GPU: the generic path (transformers' decoder layers over the paged KV cache) in the
engine `moectl serve` builds on CUDA, start-up warm-up included: a softmax-attention family and a
linear-attention hybrid (a state slot per sequence, our Triton delta rule) give transformers'
greedy tokens, and a repeated request hits its prefix (a hybrid's state snapshot restored).
Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from actors.engine.factory import build_engine
from tests.actors.checkpoints import make_generic_checkpoint
from tests.actors.model.test_generic import GREEDY, HYBRID, KW, SECRET, generate, requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v2", "deepseek_v32", *HYBRID])
def test_a_generic_family_on_cuda_decodes_as_transformers_generate(model_type, tmp_path):
    """Three requests at once (batched decodes, chunked prompts) on the CUDA engine after its
    warm-up: transformers' tokens on the CPU in float32."""
    path, ref = make_generic_checkpoint(model_type, tmp_path / model_type)
    engine = build_engine(path, device="cuda", dtype="float32", cache_key_secret=SECRET,
                          batch_invariant=False, **KW)  # fmt: skip
    assert engine.stats()["warm_up_steps"] > 0
    reqs, out = requests(), {}
    for rid, ids in reqs.items():
        engine.add_request(rid, ids, GREEDY)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid, ids in reqs.items():
        assert out[rid] == generate(ref, ids), (model_type, rid)
    # c again once the others are done: a prefix hit (for a hybrid, its state snapshot too)
    engine.add_request("again", reqs["c"], GREEDY)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out["again"] == out["c"]
    stats = engine.stats()
    assert stats["prefix_hits"] >= 1
    if model_type in HYBRID:
        assert stats["state_restores"] >= 1
