"""ParallelDims / Layout: the rank table, groups, validation and the layout shorthand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cluster.errors import InputError
from placement.parallel_dims import Axis, Layout, ParallelDims, parse_layout


def _grid(dims: ParallelDims) -> np.ndarray:
    """Independent reference: DESIGN.md's `arange(world).reshape(pp, dp, tp)`."""
    return np.arange(dims.world).reshape(dims.pp, dims.dp, dims.tp)


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (2, 2, 2), (3, 1, 4), (1, 4, 1), (2, 3, 2)])
def test_coords_and_rank_match_the_reshaped_grid(pp, dp, tp):
    dims = ParallelDims(pp=pp, dp=dp, tp=tp)
    grid = _grid(dims)
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        rank = int(grid[p, d, t])
        assert dims.rank_of(pp=p, dp=d, tp=t) == rank
        c = dims.coords(rank)
        assert (c.pp, c.dp, c.tp) == (p, d, t)


@pytest.mark.parametrize("pp,dp,tp", [(2, 2, 2), (1, 2, 1), (2, 1, 2), (3, 2, 1)])
def test_groups_are_the_grid_slices(pp, dp, tp):
    dims = ParallelDims(pp=pp, dp=dp, tp=tp)
    grid = _grid(dims)
    as_set = lambda groups: {tuple(int(r) for r in g) for g in groups}  # noqa: E731
    assert as_set(dims.groups("tp")) == as_set(grid.reshape(-1, tp))
    assert as_set(dims.groups(Axis.DP)) == as_set(grid.transpose(0, 2, 1).reshape(-1, dp))
    assert as_set(dims.groups("pp")) == as_set(grid.transpose(1, 2, 0).reshape(-1, pp))
    assert as_set(dims.groups("ep")) == as_set(grid.reshape(pp, dp * tp))
    for axis in Axis:
        flat = sorted(r for g in dims.groups(axis) for r in g)
        assert flat == list(range(dims.world)), axis


def test_docstring_table_example():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.group_of("tp", 5) == (4, 5)
    assert dims.group_of("dp", 5) == (5, 7)
    assert dims.group_of("pp", 5) == (1, 5)
    assert dims.group_of("ep", 5) == (4, 5, 6, 7)
    assert [dims.ep_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_etp_splits_a_stage_into_strided_ep_groups():
    dims = ParallelDims(pp=1, dp=2, tp=2, etp=2)
    assert dims.ep == 2
    assert dims.groups("ep") == ((0, 2), (1, 3))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"pp": 0, "dp": 1, "tp": 1}, "pp=0"),
        ({"pp": 1, "dp": 1, "tp": 2, "etp": 4}, "etp=4 does not divide dp*tp=2"),
        ({"pp": 1, "dp": 1, "tp": 1.5}, "tp=1.5"),
    ],
)
def test_bad_degrees_name_the_numbers(kwargs, needle):
    with pytest.raises(InputError, match=needle.replace("*", r"\*")):
        ParallelDims(**kwargs)


def test_check_model_names_the_counts():
    with pytest.raises(InputError, match="tp=3 does not divide 32 attention heads"):
        ParallelDims(pp=1, dp=1, tp=3).check_model(
            num_layers=4, num_attention_heads=32, num_kv_heads=8, num_experts=8
        )
    with pytest.raises(InputError, match="pp=5 exceeds the 4 layers"):
        ParallelDims(pp=5, dp=1, tp=1).check_model(
            num_layers=4, num_attention_heads=4, num_kv_heads=4, num_experts=8
        )
    with pytest.raises(InputError, match="ep=16 exceeds the 8 routed experts"):
        ParallelDims(pp=1, dp=16, tp=1).check_model(
            num_layers=4, num_attention_heads=4, num_kv_heads=4, num_experts=8
        )
    ParallelDims(pp=2, dp=2, tp=2).check_model(
        num_layers=4, num_attention_heads=4, num_kv_heads=1, num_experts=8
    )


@pytest.mark.parametrize(
    "text,pp,dp,tp",
    [
        ("ep2", 1, 2, 1),
        ("pp2", 2, 1, 1),
        ("tp2", 1, 1, 2),
        ("ep2xpp2", 2, 2, 1),
        ("ep4", 1, 4, 1),
        ("tp2xpp2", 2, 1, 2),
        ("ep4xtp2", 1, 2, 2),
        ("single", 1, 1, 1),
    ],
)
def test_parse_layout(text, pp, dp, tp):
    dims = parse_layout(text)
    assert (dims.pp, dims.dp, dims.tp) == (pp, dp, tp)
    assert parse_layout(dims.shorthand) == dims


@pytest.mark.parametrize("text", ["ep2xep2", "zz3", "ep3xtp2", "ep2xdp2", "pp0"])
def test_parse_layout_rejects(text):
    with pytest.raises(InputError, match=text):
        parse_layout(text)


def test_layout_even_split_and_contiguous_experts():
    layout = Layout.build(ParallelDims(pp=3, dp=2, tp=1), num_layers=7, num_experts=8)
    assert [list(layout.layer_range(s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [layout.stage_of(layer) for layer in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    assert layout.local_experts(0) == (0, 1, 2, 3)
    assert layout.local_experts(1) == (4, 5, 6, 7)
    assert layout.expert_owner_from(0) == (0, 0, 0, 0, 1, 1, 1, 1)


def test_layout_uneven_stages_and_replicated_experts():
    dims = ParallelDims(pp=2, dp=2, tp=1)
    owners = ((0,), (1,), (0, 1), (1,))
    layout = Layout.build(
        dims, num_layers=5, num_experts=4, stage_sizes=(1, 4), expert_owners=owners
    )
    assert list(layout.layer_range(1)) == [1, 2, 3, 4]
    assert layout.local_experts(0) == (0, 2)
    assert layout.local_experts(1) == (1, 2, 3)
    # A replicated expert is served where the token already is.
    assert layout.expert_owner_from(0)[2] == 0
    assert layout.expert_owner_from(1)[2] == 1


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"stage_sizes": (2, 2)}, "sum to 4, not 5 layers"),
        ({"stage_sizes": (5, 0)}, "at least one layer"),
        ({"expert_owners": ((0,), (0,), (0,), (0,))}, r"EP ranks \[1\] hold no expert"),
        ({"expert_owners": ((0,), (2,), (1,), (1,))}, r"expert 1 owners \(2,\)"),
        ({"expert_owners": ((0,), (1,))}, "lists 2 experts, not 4"),
    ],
)
def test_layout_validation(kwargs, needle):
    with pytest.raises(InputError, match=needle):
        Layout.build(ParallelDims(pp=2, dp=2, tp=1), num_layers=5, num_experts=4, **kwargs)


def test_layout_needs_owners_when_ep_does_not_divide_experts():
    with pytest.raises(InputError, match="ep=3 does not divide 8 experts"):
        Layout.build(ParallelDims(pp=1, dp=3, tp=1), num_layers=2, num_experts=8)
