"""Routing flips in `actors.validate.alignment.compare`: a near tie the router logits' own difference can
bridge is accepted; a flip with a wider margin (experts picked from other scores) is not."""

import torch

from actors.validate.alignment import beyond_ties, compare

GATE = "model.layers.0.mlp.gate"


def _capture(logits: torch.Tensor, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    return {GATE: [logits], f"{GATE}.topk_ids": [ids]}


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    """4 tokens over 4 experts, top-2; token 0's 2nd and 3rd logits are 1e-3 apart (a near
    tie), every other token's top-2 margin is at least 1."""
    logits = torch.tensor(
        [
            [3.0, 2.0005, 2.0, -1.0],
            [4.0, 3.0, 1.0, 0.0],
            [0.0, 5.0, 1.0, 4.0],
            [2.0, 0.0, 3.0, -2.0],
        ]
    )
    return logits, logits.topk(2, dim=-1).indices


def test_a_near_tie_flip_is_explained_and_passes_without_budget():
    ref, ids = _reference()
    got = ref.clone()
    got[0, 1] -= 1e-3  # now expert 2 beats expert 1 on token 0: a bridgeable tie
    got_ids = got.topk(2, dim=-1).indices
    assert not torch.equal(got_ids[0].sort().values, ids[0].sort().values)
    flipped = torch.tensor([True, False, False, False])
    assert beyond_ties(ref.double(), got.double(), ids, flipped) == 0
    errors, agreement = compare(_capture(ref, ids), _capture(got, got_ids), 1, tolerance=0.05)
    (router,) = errors
    assert router.flips == 1 and router.flips_beyond_ties == 0 and router.ok
    assert agreement[0] == 0.75


def test_a_flip_beyond_the_logits_difference_fails():
    ref, ids = _reference()
    got = ref.clone()
    got[1, 0] += 1e-4  # logits nearly equal, yet the run chose experts 2 and 3 for token 1
    got_ids = ids.clone()
    got_ids[1] = torch.tensor([2, 3])
    errors, _ = compare(_capture(ref, ids), _capture(got, got_ids), 1, tolerance=0.05)
    (router,) = errors
    assert router.flips == 1 and router.flips_beyond_ties == 1 and not router.ok
    # Within a flip budget it still passes (the budget alone is the older, looser rule).
    errors, _ = compare(
        _capture(ref, ids), _capture(got, got_ids), 1, tolerance=0.05, flip_budget=0.5
    )
    assert errors[0].ok


def test_a_choice_that_is_not_a_plain_top_k_falls_back_to_the_budget():
    ref, ids = _reference()
    biased = ids.clone()
    biased[2] = torch.tensor([0, 2])  # picked by other scores (e.g. a bias): no tie reasoning
    flipped = torch.tensor([False, False, True, False])
    assert beyond_ties(ref.double(), ref.double(), biased, flipped) is None
    got_ids = ids.clone()
    errors, _ = compare(_capture(ref, biased), _capture(ref, got_ids), 1, tolerance=0.05)
    assert errors[0].flips == 1 and errors[0].flips_beyond_ties is None and not errors[0].ok
