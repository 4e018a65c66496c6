"""Two CPU engine settings that must really be in effect:

- `LocalRunner.from_checkpoint` on the CPU stores the decode GEMMs' weights column-major
  (`StageModel.column_major_weights`: o_proj, experts, MLPs, lm_head; the stacked q/k/v copy
  follows), so MKL gets a plain right operand; not under Triton's interpreter, whose kernels
  read the weights' rows;
- a CPU step runs in `torch.inference_mode` (`LocalRunner._logits`): the tensors it keeps are
  inference tensors, and `forward` still returns a plain tensor.

The engine's values on these paths are checked against transformers by the engine tests
(tests/actors/engine/test_engine.py).
"""

from __future__ import annotations

import pytest

from actors.engine.engine import Engine
from actors.engine.factory import build_engine
from actors.executor import runner as runner_module
from actors.executor.runner import LocalRunner
from actors.kernels import cpu_attention
from tests.actors.checkpoints import make_tiny_checkpoint
from tests.actors.engine.test_engine import prompt
from tests.actors.kernels.test_decode import _step
from tests.actors.model.test_cpu_prefill_speed_paths import run_five


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _engine(ckpt) -> Engine:
    return build_engine(
        ckpt, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
        batch_invariant=False,
    )  # fmt: skip


def _row_major(model) -> dict[str, bool]:
    return {n: p.is_contiguous() for n, p in model.named_parameters() if p.dim() >= 2}


def test_column_major_weights_are_taken(ckpt):
    engine = _engine(ckpt)
    run_five(engine)  # builds the stacked q/k/v copy
    model = engine.runner.model
    layout = _row_major(model)
    moved = {n for n, rows in layout.items() if not rows}
    assert any(n.endswith("experts.w_gate_up") for n in moved)
    assert any(n.endswith("experts.w_down") for n in moved)
    assert "lm_head.weight" in moved or model.arch.tie_word_embeddings
    assert not any("kv_b_proj" in n or "embed_tokens" in n for n in moved)
    if any(n.endswith("o_proj.weight") for n in moved):  # GQA: the stacked q/k/v copy too
        stacks = [
            layer.self_attn.__dict__["_cpu_stack"][1] for layer in model.layers.values()
        ]  # fmt: skip
        assert stacks and all(w.stride(0) == 1 for w in stacks)


def test_column_major_not_under_triton(ckpt, monkeypatch):
    monkeypatch.setattr(runner_module.fused, "use_triton", lambda x: True)
    runner = LocalRunner.from_checkpoint(ckpt)
    assert all(_row_major(runner.model).values())


def test_cpu_steps_run_in_inference_mode_and_return_plain_tensors(ckpt, monkeypatch):
    # the decode mirror (kept across steps, extended in place; SDPA's path, so without the C
    # decode kernel) is made inside the mode
    monkeypatch.setattr(cpu_attention, "ENABLED", [False])
    runner = _engine(ckpt).runner
    runner.allocate_kv(64, 4)
    seqs, tables = [prompt(6, 1), prompt(5, 2)], [[3, 7], [2, 5]]
    runner.execute(_step(seqs, [6, 5], tables, 4))
    for s in seqs:
        s.append(7)
    runner.execute(_step(seqs, [1, 1], tables, 4))
    assert runner.mirror.k and all(k.is_inference() for k in runner.mirror.k.values())
    for s in seqs:
        s.append(9)
    logits = runner.forward(_step(seqs, [1, 1], tables, 4))  # extends the mirror again
    assert not logits.is_inference()
    logits.add_(1.0)  # a plain tensor: callers may change it in place
