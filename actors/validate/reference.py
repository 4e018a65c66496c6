"""The reference side of `moectl validate`: transformers' own model, hooked module by module.

Forward hooks on the Hugging Face modules record the output of `model.embed_tokens`, every
`model.layers.{i}` and its `self_attn`, `mlp`, `mlp.gate`, `mlp.experts`, `mlp.shared_experts`,
then `model.norm` and `lm_head`: the names `StageModel` uses for its own captures. Modules that
return tuples are reduced to the tensor that matches ours: attention -> its output (not the
attention weights); a router -> its float [T, E] logits (`.gate`) and its integer expert choice
(`.gate.topk_ids`), found by shape and dtype since the order differs between families.
transformers is imported lazily (it is not on the engine's import path).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from cluster.errors import InputError

LAYER_MODULES = ("self_attn", "mlp", "mlp.gate", "mlp.experts", "mlp.shared_experts")
_TOP_MODULES = ("model.embed_tokens", "model.norm", "lm_head")


def load_reference_model(directory: str | Path):
    """transformers `AutoModelForCausalLM` of `directory`, float32, eager attention, eval mode.

    A tensor transformers expected but did not find would be left at random init and make every
    comparison meaningless: that is an InputError naming the tensor.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    d = Path(directory)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"reference {d}: transformers cannot load it ({first})") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise InputError(
            f"reference {d}: transformers found no tensor {missing[0]} ({len(missing)} missing)"
        )
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        name, got, want = [*mismatched[0], None, None][:3]
        raise InputError(f"reference {d}: tensor {name} has shape {got}, the model expects {want}")
    return model.eval()


def primary(name: str, out) -> dict[str, torch.Tensor]:
    """The comparable tensor(s) of one module's output, batch dimension removed."""
    if name.endswith(".mlp.gate"):
        parts = out if isinstance(out, tuple) else (out,)
        found: dict[str, torch.Tensor] = {}
        tensors = [t for t in parts if isinstance(t, torch.Tensor)]
        floats = [t for t in tensors if t.is_floating_point()]
        ints = [t for t in tensors if not t.is_floating_point()]
        # The logits are the widest float output ([T, E]; the weights are [T, K]).
        found["logits"] = max(floats, key=lambda t: t.shape[-1])
        if ints:
            found["ids"] = ints[0]
        res = {name: found["logits"].reshape(-1, found["logits"].shape[-1])}
        if "ids" in found:
            res[f"{name}.topk_ids"] = found["ids"].reshape(-1, found["ids"].shape[-1])
        return res
    t = out[0] if isinstance(out, tuple) else out
    return {name: t.reshape(-1, t.shape[-1])}


def capture_hooks(modules: dict[str, torch.nn.Module], sink: dict) -> list:
    """Forward hooks putting each module's `primary` output into `sink` under its name;
    returns the handles (remove them when done)."""

    def hook_for(name: str):
        def hook(module, args, out) -> None:
            sink.update(primary(name, out))

        return hook

    return [m.register_forward_hook(hook_for(name)) for name, m in modules.items()]


def reference_capture(model, sequences: Sequence[Sequence[int]]) -> dict[str, list[torch.Tensor]]:
    """One forward per sequence; HF module name -> [num_sequences] tensors [L_i, ...] (float32)."""
    wanted = set(_TOP_MODULES)
    for i in range(model.config.num_hidden_layers):
        wanted.add(f"model.layers.{i}")
        wanted.update(f"model.layers.{i}.{m}" for m in LAYER_MODULES)
    current: dict[str, torch.Tensor] = {}
    handles = capture_hooks(
        {name: m for name, m in model.named_modules() if name in wanted}, current
    )
    out: dict[str, list[torch.Tensor]] = {}
    try:
        with torch.no_grad():
            for seq in sequences:
                current.clear()
                model(input_ids=torch.tensor([list(seq)], dtype=torch.int64))
                for name, value in current.items():
                    out.setdefault(name, []).append(value.detach().clone())
    finally:
        for h in handles:
            h.remove()
    return out
