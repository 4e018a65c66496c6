"""The runner protocol: every call the engine (`actors.engine.engine.Engine`) makes on a runner.

Two runners implement it: `actors.executor.runner.LocalRunner` (one rank holding every layer, in
this process) and `actors.executor.replica.Replica` (the driver side of a multi-rank replica of
Ray actors). A step is described by `actors.executor.step.StepInput`; only sampled token ids and
the requested logprobs come back (`StepOutput`), never vocabulary-sized logits.

Async scheduling (`actors.engine.overlap`): a runner whose `overlaps(step)` is true runs that
step through `launch` (the tokens stay on the device) and `collect` (the host reads them); one
that never overlaps answers False and is only ever called through `execute`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from actors.executor.step import StepInput, StepOutput
    from actors.kv.cache import KVLayout
    from actors.kv.tiers import KVTiers
    from actors.model.arch import ArchConfig
    from cache_service.block_key import BlockKey


@runtime_checkable
class Runner(Protocol):
    device: torch.device
    """Where the model runs (CPU, or the CUDA device of the runner's ranks)."""

    @property
    def arch(self) -> ArchConfig:
        """The checkpoint's hyperparameters."""
        ...

    @property
    def kv_layout(self) -> KVLayout:
        """The whole model's KV block layout (every layer, every KV head): what the tiers store."""
        ...

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVLayout:
        """(Re)create an empty paged cache of `num_blocks` blocks; returns the whole layout."""
        ...

    def execute(self, step: StepInput) -> StepOutput:
        """Forward the step's new tokens and sample the rows of `step.sample_seqs`."""
        ...

    def overlaps(self, step: StepInput) -> bool:
        """Whether `step` may run through `launch` / `collect` (async scheduling)."""
        ...

    def launch(self, step: StepInput, *, after: Any = None) -> Any:
        """Start `step` (its input ids the device tokens of `after`, when given); `collect`
        takes what this returns."""
        ...

    def collect(self, launched: Any) -> StepOutput:
        """The tokens of a launched step (waits for them)."""
        ...

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` into block `dst` where it lives (no host round trip)."""
        ...

    def timing_stats(self) -> dict[str, object]:
        """Per-step timing the runner measures (per pipeline stage and comm axis); {} if none."""
        ...

    # -- KV blocks and the tiers: the data moves where the KV lives, the engine sends keys --

    def attach_tiers(self, tiers: KVTiers, *, key_secret: bytes) -> None:
        """Move blocks through `tiers` (the engine's door to the cache, its counters the
        engine's): the in-process runner uses it as it is; a multi-rank replica has each rank
        open its own over the same cache, for its own slice of every block, whose key it
        derives with `key_secret` (the engine's block-key secret)."""
        ...

    def available_kv(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` (whole-model block keys) the tiers hold whole
        (every slice of them, where the ranks store slices); a lookup, no data moves."""
        ...

    def store_kv(self, blocks: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
        """Write device blocks `blocks` to the tiers under `keys` (whole-model block keys), in
        one batched call per rank; one flag per block: newly stored (False: the tiers had it, or
        a put faulted, counted in the tiers' `faults`)."""
        ...

    def load_kv(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> int:
        """Read the leading blocks of `keys` from the tiers into device blocks `blocks` (one
        batched call per rank); how many leading blocks landed whole and verified."""
        ...


class InOrder:
    """The async-scheduling calls of a runner that runs every step through `execute` (the
    multi-rank replica, whose tokens are read on the driver each step)."""

    def overlaps(self, step: StepInput) -> bool:
        return False

    def launch(self, step: StepInput, *, after: Any = None) -> Any:
        raise RuntimeError(f"{type(self).__name__} does not overlap steps: use execute")

    def collect(self, launched: Any) -> StepOutput:
        raise RuntimeError(f"{type(self).__name__} does not overlap steps: use execute")

    def timing_stats(self) -> dict[str, object]:
        return {}
