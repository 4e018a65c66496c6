"""Parallel degrees of one model replica and the one rank table every package uses.

`world = pp x dp x tp` (DESIGN.md, "Parallel axes"). Attention in a pipeline stage is replicated
over `dp` ranks holding different sequences and split over `tp` ranks by heads; the MoE layers of
the stage use the same `dp x tp` ranks as their expert-parallel group, so `ep = dp x tp / etp`.

Pure: no torch.distributed, no Ray. `Layout` adds what runs where: layer -> pipeline stage and
expert -> EP rank(s); the planner's Plan contains one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from cluster.errors import InputError


class Axis(StrEnum):
    """A parallel axis; `groups(axis)` lists the rank groups of each."""

    PP = "pp"
    DP = "dp"
    TP = "tp"
    EP = "ep"


@dataclass(frozen=True, kw_only=True)
class Coord:
    """Coordinates of one rank in the `[pp, dp, tp]` grid."""

    pp: int
    """Pipeline stage index."""
    dp: int
    """Data-parallel (attention) index inside the stage."""
    tp: int
    """Tensor-parallel index inside the data-parallel replica."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Parallel degrees of one replica, validated once.

    The ranks of the replica's world are `arange(world).reshape(pp, dp, tp)`:

        rank = (pp_idx * dp + dp_idx) * tp + tp_idx

    e.g. pp=2, dp=2, tp=2 (world 8):

        rank | pp dp tp | tp group | dp group | pp group | ep group
        -----+----------+----------+----------+----------+-------------
          0  |  0  0  0 | (0, 1)   | (0, 2)   | (0, 4)   | (0, 1, 2, 3)
          1  |  0  0  1 | (0, 1)   | (1, 3)   | (1, 5)   | (0, 1, 2, 3)
          2  |  0  1  0 | (2, 3)   | (0, 2)   | (2, 6)   | (0, 1, 2, 3)
          3  |  0  1  1 | (2, 3)   | (1, 3)   | (3, 7)   | (0, 1, 2, 3)
          4  |  1  0  0 | (4, 5)   | (4, 6)   | (0, 4)   | (4, 5, 6, 7)
          5  |  1  0  1 | (4, 5)   | (5, 7)   | (1, 5)   | (4, 5, 6, 7)
          6  |  1  1  0 | (6, 7)   | (4, 6)   | (2, 6)   | (4, 5, 6, 7)
          7  |  1  1  1 | (6, 7)   | (5, 7)   | (3, 7)   | (4, 5, 6, 7)

    TP neighbours are adjacent (packed inside an NVLink domain), a stage's `dp x tp` ranks are
    contiguous, and the pipeline axis is the slowest. With etp > 1 the ranks of a stage form
    `etp` expert-parallel groups of `ep` ranks each, taken with stride `etp`.
    """

    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel attention replicas per stage (different sequences)."""
    tp: int
    """Tensor-parallel ranks per attention replica (heads split)."""
    etp: int = 1
    """Expert-tensor-parallel degree: ranks that split one expert's matrices."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"parallel degree {name}={value!r}: expected an integer >= 1")
        if (self.dp * self.tp) % self.etp:
            raise InputError(
                f"etp={self.etp} does not divide dp*tp={self.dp * self.tp} ranks of a stage"
            )

    @property
    def world(self) -> int:
        """Ranks in the replica: pp * dp * tp."""
        return self.pp * self.dp * self.tp

    @property
    def ep(self) -> int:
        """Expert-parallel degree: dp * tp / etp."""
        return self.dp * self.tp // self.etp

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_kv_heads: int,
        num_experts: int,
    ) -> None:
        """Raise InputError when the degrees cannot split this model (counts from its config)."""
        if self.tp > 1 and num_attention_heads % self.tp:
            raise InputError(f"tp={self.tp} does not divide {num_attention_heads} attention heads")
        if self.tp > 1 and num_kv_heads % self.tp and self.tp % num_kv_heads:
            raise InputError(
                f"tp={self.tp} neither divides nor is a multiple of {num_kv_heads} KV heads"
            )
        if self.pp > num_layers:
            raise InputError(f"pp={self.pp} exceeds the {num_layers} layers of the model")
        if num_experts and self.ep > num_experts:
            raise InputError(f"ep={self.ep} exceeds the {num_experts} routed experts")

    def coords(self, rank: int) -> Coord:
        """Rank -> (pp, dp, tp); the inverse of `rank_of`. See the class docstring's table."""
        if not 0 <= rank < self.world:
            raise InputError(f"rank {rank} is outside the world of {self.world} ranks")
        pp_idx, rest = divmod(rank, self.dp * self.tp)
        dp_idx, tp_idx = divmod(rest, self.tp)
        return Coord(pp=pp_idx, dp=dp_idx, tp=tp_idx)

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        """(pp, dp, tp) -> rank = (pp * dp_size + dp) * tp_size + tp."""
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise InputError(
                f"coordinates pp={pp} dp={dp} tp={tp} are outside pp={self.pp} dp={self.dp} tp={self.tp}"
            )
        return (pp * self.dp + dp) * self.tp + tp

    def ep_rank(self, rank: int) -> int:
        """Index of `rank` inside its expert-parallel group (0 .. ep-1)."""
        c = self.coords(rank)
        return (c.dp * self.tp + c.tp) // self.etp

    def groups(self, axis: Axis | str) -> tuple[tuple[int, ...], ...]:
        """Every group of `axis` as sorted rank tuples; each rank is in exactly one per axis."""
        axis = Axis(axis)
        out: list[tuple[int, ...]] = []
        if axis is Axis.TP:
            for p in range(self.pp):
                for d in range(self.dp):
                    out.append(tuple(self.rank_of(pp=p, dp=d, tp=t) for t in range(self.tp)))
        elif axis is Axis.DP:
            for p in range(self.pp):
                for t in range(self.tp):
                    out.append(tuple(self.rank_of(pp=p, dp=d, tp=t) for d in range(self.dp)))
        elif axis is Axis.PP:
            for d in range(self.dp):
                for t in range(self.tp):
                    out.append(tuple(self.rank_of(pp=p, dp=d, tp=t) for p in range(self.pp)))
        else:
            stage = self.dp * self.tp
            for p in range(self.pp):
                for e in range(self.etp):
                    out.append(tuple(p * stage + i for i in range(e, stage, self.etp)))
        return tuple(out)

    def group_of(self, axis: Axis | str, rank: int) -> tuple[int, ...]:
        """The group of `axis` that contains `rank`."""
        for group in self.groups(axis):
            if rank in group:
                return group
        raise InputError(f"rank {rank} is outside the world of {self.world} ranks")

    @property
    def shorthand(self) -> str:
        """Short name such as "ep2xpp2" (see `parse_layout`)."""
        parts = []
        if self.dp > 1:
            parts.append(f"ep{self.dp * self.tp}" if self.tp == 1 else f"dp{self.dp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        return "x".join(parts) or "single"


_TERM = re.compile(r"^(ep|dp|tp|pp|etp)(\d+)$")


def parse_layout(text: str) -> ParallelDims:
    """Parse a shorthand such as "ep2", "pp2", "tp2", "ep2xpp2", "ep4", "tp2xpp2", "single".

    `epN` (without tp) means N data-parallel attention ranks whose experts are split over all N
    (dp=N); `dpN` is the same degree spelled by its attention axis; with `tpM` present, `epN`
    sets dp = N / M. Each axis may appear once.
    """
    text = text.strip().lower()
    if text in ("single", "1", ""):
        return ParallelDims(pp=1, dp=1, tp=1)
    seen: dict[str, int] = {}
    for term in text.split("x"):
        match = _TERM.match(term)
        if not match:
            raise InputError(
                f"layout {text!r}: term {term!r} is not one of epN, dpN, tpN, ppN, etpN"
            )
        name, value = match.group(1), int(match.group(2))
        if name in seen:
            raise InputError(f"layout {text!r}: axis {name} appears twice")
        if value < 1:
            raise InputError(f"layout {text!r}: {name}{value} must be >= 1")
        seen[name] = value
    if "ep" in seen and "dp" in seen:
        raise InputError(f"layout {text!r}: give ep or dp, not both")
    tp = seen.get("tp", 1)
    etp = seen.get("etp", 1)
    if "ep" in seen:
        ranks = seen["ep"] * etp
        if ranks % tp:
            raise InputError(f"layout {text!r}: tp={tp} does not divide ep*etp={ranks}")
        dp = ranks // tp
    else:
        dp = seen.get("dp", 1)
    return ParallelDims(pp=seen.get("pp", 1), dp=dp, tp=tp, etp=etp)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What runs where in one replica: degrees, layer -> stage, expert -> EP rank(s).

    Build with `Layout.build(...)`; the fields are the resolved tables.
    """

    dims: ParallelDims
    """Parallel degrees."""
    num_layers: int
    """Decoder layers of the model."""
    num_experts: int
    """Routed experts per MoE layer (0 for a dense model)."""
    stage_bounds: tuple[tuple[int, int], ...]
    """[pp] half-open layer range `(start, end)` of each pipeline stage, contiguous and covering."""
    expert_owners: tuple[tuple[int, ...], ...]
    """[num_experts] EP-group ranks (0 .. ep-1) holding a copy of each expert (replicas allowed)."""

    @classmethod
    def build(
        cls,
        dims: ParallelDims,
        *,
        num_layers: int,
        num_experts: int,
        stage_sizes: tuple[int, ...] | None = None,
        expert_owners: tuple[tuple[int, ...], ...] | None = None,
    ) -> Layout:
        """Even layer split and contiguous expert blocks unless `stage_sizes` / `expert_owners` given.

        Even split: the first `num_layers % pp` stages take one layer more. Contiguous experts:
        EP rank r holds experts `[r*E/ep, (r+1)*E/ep)`.
        """
        if num_layers < 1:
            raise InputError(f"num_layers={num_layers}: expected >= 1")
        if num_experts < 0:
            raise InputError(f"num_experts={num_experts}: expected >= 0")
        if stage_sizes is None:
            base, extra = divmod(num_layers, dims.pp)
            stage_sizes = tuple(base + (1 if s < extra else 0) for s in range(dims.pp))
        if expert_owners is None:
            if num_experts % dims.ep:
                raise InputError(
                    f"ep={dims.ep} does not divide {num_experts} experts; pass expert_owners"
                )
            per = num_experts // dims.ep
            expert_owners = tuple((e // per,) for e in range(num_experts))
        bounds, start = [], 0
        for size in stage_sizes:
            bounds.append((start, start + size))
            start += size
        return cls(
            dims=dims,
            num_layers=num_layers,
            num_experts=num_experts,
            stage_bounds=tuple(bounds),
            expert_owners=tuple(tuple(o) for o in expert_owners),
        )

    def __post_init__(self) -> None:
        pp = self.dims.pp
        if len(self.stage_bounds) != pp:
            raise InputError(f"{len(self.stage_bounds)} stage sizes given for pp={pp} stages")
        sizes = [end - start for start, end in self.stage_bounds]
        if any(s < 1 for s in sizes):
            raise InputError(f"stage sizes {sizes}: every stage needs at least one layer")
        if sum(sizes) != self.num_layers or self.stage_bounds[0][0] != 0:
            raise InputError(
                f"stage sizes {sizes} sum to {sum(sizes)}, not {self.num_layers} layers"
            )
        if len(self.expert_owners) != self.num_experts:
            raise InputError(
                f"expert_owners lists {len(self.expert_owners)} experts, not {self.num_experts}"
            )
        for e, owners in enumerate(self.expert_owners):
            if not owners or any(not 0 <= r < self.dims.ep for r in owners):
                raise InputError(
                    f"expert {e} owners {owners}: expected EP ranks in [0, {self.dims.ep})"
                )
        held = {r for owners in self.expert_owners for r in owners}
        if self.num_experts and len(held) != self.dims.ep:
            idle = sorted(set(range(self.dims.ep)) - held)
            raise InputError(f"EP ranks {idle} hold no expert")

    def stage_of(self, layer: int) -> int:
        """Pipeline stage that holds `layer`."""
        for stage, (start, end) in enumerate(self.stage_bounds):
            if start <= layer < end:
                return stage
        raise InputError(f"layer {layer} is outside the {self.num_layers} layers")

    def layer_range(self, stage: int) -> range:
        """Layers of pipeline stage `stage`."""
        start, end = self.stage_bounds[stage]
        return range(start, end)

    def local_experts(self, ep_rank: int) -> tuple[int, ...]:
        """Global expert ids held by EP rank `ep_rank`, ascending."""
        return tuple(e for e, owners in enumerate(self.expert_owners) if ep_rank in owners)

    def expert_owner_from(self, src_ep_rank: int) -> tuple[int, ...]:
        """[num_experts] the EP rank a token on `src_ep_rank` is sent to, one per expert.

        A replicated expert is served locally when `src_ep_rank` holds a copy, otherwise by the
        replica `owners[src_ep_rank % len(owners)]`, spreading senders over the copies.
        """
        table = []
        for owners in self.expert_owners:
            table.append(
                src_ep_rank if src_ep_rank in owners else owners[src_ep_rank % len(owners)]
            )
        return tuple(table)
