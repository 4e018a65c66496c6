"""The generic path (`actors/model/generic.py`): families the native layers do not implement
run as transformers' own decoder layers over the paged KV cache, in the engine, continuously
batched, with prefix hits, over LocalRunner and over pipeline stages of ShardWorker actors; the
greedy tokens equal transformers' `generate`. Families whose attention the paged cache cannot
serve are refused naming the module. Tiny random checkpoints made by transformers' classes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from actors.engine.factory import build_engine
from actors.engine.sampler import SamplingParams
from actors.model.weights import CheckpointIndex, load_stage_model
from cluster.errors import InputError
from tests.actors.checkpoints import make_generic_checkpoint
from tests.actors.engine.test_engine import prompt

GENERIC = tuple(
    t
    for t in (
        "olmoe", "qwen2_moe", "granitemoe", "phimoe", "ernie4_5_moe", "minimax_m2", "glm4_moe",
        "flex_olmo", "cohere2_moe", "exaone_moe", "deepseek_v2", "glm4_moe_lite", "sarvam_mla",
        "axk1",
    )
    if t in transformers.CONFIG_MAPPING
)  # fmt: skip
"""MoE families not implemented natively that the generic path serves (those the installed
transformers ships)."""
HYBRID = tuple(
    t for t in ("qwen3_next", "qwen3_5_moe", "kimi_linear") if t in transformers.CONFIG_MAPPING
)
"""Linear-attention hybrids (gated DeltaNet beside gated softmax attention; KDA beside NoPE
MLA): a state per sequence (actors/model/linear_state.py) beside the paged KV of the attention
layers."""

SECRET = b"k" * 32
KW = dict(num_blocks=64, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def test_at_least_six_generic_families_are_shipped():
    assert len(GENERIC) >= 6, GENERIC


def requests():
    shared = prompt(13, 0)
    return {"a": shared + prompt(4, 1), "b": prompt(5, 2), "c": shared + prompt(2, 3)}


def run_engine(engine) -> dict[str, list[int]]:
    """a and b together (chunked: 24 tokens a step), c joins two steps later and hits a's
    cached prefix."""
    reqs, out = requests(), {}
    engine.add_request("a", reqs["a"], GREEDY)
    engine.add_request("b", reqs["b"], GREEDY)
    for n in range(200):
        if n == 2:
            engine.add_request("c", reqs["c"], GREEDY)
        if not engine.has_unfinished() and n > 2:
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def generate(model, ids) -> list[int]:
    got = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    return got[0, len(ids) :].tolist()


@pytest.mark.parametrize("model_type", GENERIC)
def test_a_generic_family_decodes_as_transformers_generate(model_type, tmp_path):
    path, ref = make_generic_checkpoint(model_type, tmp_path / model_type)
    arch = CheckpointIndex.open(path).arch()
    assert arch.generic and arch.family == model_type
    engine = build_engine(path, cache_key_secret=SECRET, batch_invariant=False, **KW)
    got = run_engine(engine)
    assert engine.stats()["prefix_hits"] >= 3  # c reused a's first blocks
    for rid, ids in requests().items():
        assert got[rid] == generate(ref, ids), (model_type, rid)


@pytest.mark.parametrize("model_type", HYBRID)
def test_a_linear_attention_hybrid_decodes_as_transformers_generate(
    model_type, tmp_path, monkeypatch
):
    """Chunked prefill carrying each sequence's state across chunks (cut at block
    boundaries), decodes batched over their state slots, a request joining later that starts
    from a's cached blocks and the state snapshot after them: transformers' tokens. The
    stage's delta rule is ours (actors/kernels/delta_rule.py), chunked and recurrent, in
    place of the modeling file's."""
    from actors.kernels import delta_rule

    calls = {}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return run

    for name, fn in delta_rule.KERNELS.items():
        monkeypatch.setitem(delta_rule.KERNELS, name, counted(fn.__name__, fn))
    path, ref = make_generic_checkpoint(model_type, tmp_path / model_type)
    arch = CheckpointIndex.open(path).arch()
    assert arch.linear_layers and set(arch.linear_layers) < set(range(arch.num_layers))
    engine = build_engine(path, cache_key_secret=SECRET, batch_invariant=False,
                          **{**KW, "max_num_batched_tokens": 8})  # fmt: skip
    got = run_engine(engine)  # a's 17 prompt tokens in chunks beside b's and the decodes
    stats = engine.stats()
    assert stats["prefix_hits"] >= 2 and stats["state_restores"] >= 1  # c reused a's
    for rid, ids in requests().items():
        assert got[rid] == generate(ref, ids), (model_type, rid)
    assert calls.get("chunk_delta_rule", 0) > 0 and calls.get("recurrent_delta_rule", 0) > 0
    stage = engine.runner.model
    assert sorted(stage.states.recurrent) == list(arch.linear_layers)
    assert stage.states.recurrent[arch.linear_layers[0]].shape[0] <= KW["max_num_seqs"]


@pytest.mark.parametrize("model_type", HYBRID)
def test_a_hybrids_logprobs_equal_transformers_over_a_chunked_prefill_and_32_steps(
    model_type, tmp_path
):
    """Float32, relative error below 1e-4: a 20-token prompt in chunks of 8 (cut at block
    boundaries), then 32 greedy decode steps from the carried states."""
    from tests.actors.model.test_generic_dsa import SCORED, logprobs, reference

    path, ref = make_generic_checkpoint(model_type, tmp_path / model_type)
    ids = prompt(20, 1)
    want_tokens, want = reference(ref, ids)
    engine = build_engine(path, cache_key_secret=SECRET, batch_invariant=False,
                          **{**KW, "max_num_batched_tokens": 8})  # fmt: skip
    engine.add_request("r", ids, SCORED)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == want_tokens
    got = logprobs(outs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.skipif(not HYBRID, reason="no linear-attention hybrid in this transformers")
def test_a_preempted_hybrid_sequence_restarts_its_state(tmp_path):
    """Blocks for one and a half sequences: the newer one is preempted (its state slot freed,
    another sequence's state written there meanwhile) and recomputed from its first token.
    The start-up warm-up ran first (as on CUDA): it gives its sequences state slots too."""
    from actors.engine.warm_up import warm_up

    path, ref = make_generic_checkpoint(HYBRID[0], tmp_path / "h")
    engine = build_engine(path, cache_key_secret=SECRET, batch_invariant=False,
                          **{**KW, "num_blocks": 7})  # fmt: skip
    assert warm_up(engine)["warm_up_steps"] > 0
    reqs, out = requests(), {}
    for rid in ("a", "b"):
        engine.add_request(rid, reqs[rid], GREEDY)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.stats()["preemptions"] >= 1
    for rid in ("a", "b"):
        assert out[rid] == generate(ref, reqs[rid]), rid


@pytest.mark.ray
@pytest.mark.parametrize(("model_type", "layout"), [("olmoe", "pp2"), ("qwen2_moe", "ep2"),
                                                    ("olmoe", "ep2xpp2"),
                                                    ("qwen3_next", "pp2"),
                                                    ("kimi_linear", "ep2xpp2"),
                                                    ("deepseek_v32", "pp2")])  # fmt: skip
def test_generic_layouts_over_rank_actors_equal_transformers(
    model_type, layout, ray_session, tmp_path
):
    """Over ShardWorker actors: pp (hidden states between the stages through the step channel,
    each stage building and loading only its own layers) and ep (each rank keeps its experts'
    rows of the fused weights; the (token, k) rows go to the rank holding their expert through
    transformers' experts interface `moe_ep`, attention data-parallel): transformers' tokens.
    A hybrid over pp2 keeps its state snapshots on the ranks (each its layers'), restored by
    a later request's first step."""
    path, ref = make_generic_checkpoint(model_type, tmp_path / model_type)
    want = {rid: generate(ref, ids) for rid, ids in requests().items()}
    kw = {**KW, "max_num_batched_tokens": 8} if model_type in HYBRID else KW  # chunked
    engine = build_engine(path, layout=layout, num_cpus=0.25, cache_key_secret=SECRET, **kw)
    try:
        assert run_engine(engine) == want
        if model_type in HYBRID and layout == "pp2":  # one DP rank: snapshots on the ranks
            assert engine.stats()["state_restores"] >= 1  # c started from a's blocks and state
    finally:
        engine.runner.shutdown()


def test_a_stage_holds_and_reads_only_its_layers(tmp_path):
    path, ref = make_generic_checkpoint("qwen2_moe", tmp_path / "q")
    stage, _ = load_stage_model(path, layer_range=(2, 4))
    assert list(stage.layers) == ["2", "3"] and stage.embed_tokens is None and stage.last
    theirs = dict(ref.named_parameters())
    for name, p in stage.layers.named_parameters():
        torch.testing.assert_close(p, theirs[f"model.layers.{name}"], rtol=0, atol=0)
    first, _ = load_stage_model(path, layer_range=(0, 2))
    assert first.norm is None and first.lm_head is None and first.embed_tokens is not None


def test_tp_is_refused_naming_the_model_type(tmp_path):
    path, _ = make_generic_checkpoint("olmoe", tmp_path / "o")
    with pytest.raises(InputError, match=r"model_type='olmoe'.*experts only: no tp"):
        load_stage_model(path, layer_range=(0, 4), tp_size=2)


def test_an_ep_rank_keeps_only_its_experts_rows(tmp_path):
    from actors.model.generic import EXPERTS

    path, ref = make_generic_checkpoint("olmoe", tmp_path / "o")

    class Ep:  # what shard_experts reads of an ExpertParallel
        def for_layer(self, layer):
            return ("ep", layer)

    stage, _ = load_stage_model(path, layer_range=(0, 4), local_experts=[2, 3], ep=Ep())
    theirs = dict(ref.named_parameters())
    for path_, m in stage.experts_modules():
        full = theirs[f"{path_}.gate_up_proj"]
        torch.testing.assert_close(m.gate_up_proj, full[2:4], rtol=0, atol=0)
        assert (
            m._moe_local.tolist() == [-1, -1, 0, 1] and m.config._experts_implementation == EXPERTS
        )


@pytest.mark.parametrize(
    ("model_type", "named"),
    [
        ("granitemoe_swa", r"GraniteMoeSWAModel: no single rotary_emb"),
        ("gpt_oss", r"model\.layers\.0\.self_attn: GptOssAttention has attention sinks"),
        ("deepseek_v4", r"model\.layers\.0\.self_attn: DeepseekV4Attention \(heavily_compressed"),
    ],
)
def test_attention_the_paged_cache_cannot_serve_is_refused_naming_the_module(
    model_type, named, tmp_path
):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    path, _ = make_generic_checkpoint(model_type, tmp_path / model_type)
    with pytest.raises(InputError, match=named):
        load_stage_model(path, layer_range=(0, 4))


@pytest.mark.skipif(not HYBRID, reason="no linear-attention hybrid in this transformers")
def test_a_hybrid_whose_layer_types_miss_a_layer_names_both_counts(tmp_path):
    path, _ = make_generic_checkpoint(HYBRID[0], tmp_path / "h")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:3]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError) as err:
        CheckpointIndex.open(path).arch()
    message = str(err.value)
    assert "\n" not in message and "config.json" in message
    assert "num_hidden_layers` (4)" in message and "layer_types` (3)" in message


def test_a_model_type_transformers_does_not_know_is_one_line(tmp_path):
    path, _ = make_generic_checkpoint("olmoe", tmp_path / "o")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "no_such_moe"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="model_type='no_such_moe' is known neither natively nor"):
        CheckpointIndex.open(path).arch()
