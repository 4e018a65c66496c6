"""Every tensor of a checkpoint directory against what our loader maps (names and shapes).

The whole model is listed on the meta device as one rank (`StageModel.shares`), so nothing is
allocated or read: a share naming a tensor the checkpoint lacks is `missing`, one whose logical
shape differs is `mismatched`, and a checkpoint tensor no share reads is `unmapped` (a renamed or
new tensor the runtime would silently ignore). Tensors the forward pass never uses (layers past
num_hidden_layers, such as DeepSeek's multi-token-prediction layer) are listed apart.
"""

from __future__ import annotations

from pathlib import Path


def check_checkpoint(directory: Path, *, runtime_ok: bool) -> dict:
    """{checked, tensors, mapped, missing, mismatched, unmapped, ignored, problems}; `problems`
    is [(tensor name, one-line message)]."""
    from actors.model.stage import StageModel
    from actors.model.weights import CheckpointIndex, completeness

    index = CheckpointIndex.open(directory)
    names = index.logical_names()
    if not runtime_ok:
        return {"checked": False, "tensors": len(names), "mapped": 0, "missing": [],
                "mismatched": [], "unmapped": [], "ignored": [], "problems": [],
                "note": "the runtime has no family for this model: its loader maps none of it"}  # fmt: skip
    arch = index.arch()
    stage = StageModel(arch, layer_range=(0, arch.num_layers), first=True, last=True, device="meta")
    missing, mismatched, good = [], [], []
    for s in stage.shares(index):
        if s.name not in index:
            missing.append({"name": s.name, "expected": list(s.shape)})
        elif index.logical_shape(s.name) != s.shape:
            got = list(index.logical_shape(s.name))
            mismatched.append({"name": s.name, "expected": list(s.shape), "found": got})
        else:
            good.append(s)
    cover = completeness(index, {0: good})
    problems = [
        (m["name"], f"missing: our loader expects it with shape {m['expected']}") for m in missing
    ]
    problems += [
        (m["name"], f"shape {m['found']} in the checkpoint, our loader expects {m['expected']}")
        for m in mismatched
    ]
    problems += [
        (n, "unmapped: no parameter of our runtime reads this tensor") for n in cover.unowned
    ]
    problems += [(n, f"only partly mapped ({k} elements unread)") for n, k in cover.partial]
    return {
        "checked": True,
        "tensors": len(names),
        "mapped": len({s.name for s in good}),
        "missing": missing,
        "mismatched": mismatched,
        "unmapped": list(cover.unowned),
        "ignored": list(cover.ignored),
        "problems": problems,
    }
