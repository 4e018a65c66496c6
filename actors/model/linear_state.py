"""Per-sequence state of linear-attention layers (gated DeltaNet, KDA) beside the paged KV cache.

A linear-attention layer keeps no KV: each sequence carries a short-convolution window and a
recurrent state of fixed size. transformers' own modules (Qwen3NextGatedDeltaNet and its kin)
read and write both through the cache interface of `transformers.cache_utils`
(`update_conv_state`, `update_recurrent_state`, and to read: `get_conv_state` /
`get_recurrent_state` in transformers 5.2x, `has_previous_state` and `layers[i].conv_states` in
5.1x); this gives them that interface over a pool with one row per engine state slot:

Step 1: the engine gives every running sequence a state slot (`StepInput.state_slots`, from the
        scheduler; freed when the sequence finishes or is preempted). A sequence starting from
        a cached prefix has its slot filled from a snapshot row first (`StepInput.
        state_restores`); a chunk ending on a block boundary leaves its slot's states in a
        snapshot row (`state_saves`; actors/engine/snapshots.py keeps which row is whose).
Step 2: a step's tokens come as one row [1, T, H]. `mixed_forward` splits them by sequence: the
        sequences that continue by one token (decodes) run together as a batch [S, 1, H] (the
        module's recurrent form), every other sequence alone (its chunked form: a fresh prompt,
        or a later chunk of a chunked prefill continuing from its state).
Step 3: each group's states are gathered from the pool by slot, handed to the module through a
        `SlotStates` view, and written back after it ran.

The pool grows to the highest slot seen (at most max_num_seqs rows a layer); a slot's state is
whatever its last sequence left, and a fresh sequence (context length = its new tokens) starts
from none. What is not done here: snapshots inside a chunk (only where a chunk ends), snapshots
of the Ray replica's ranks in the tiers (they stay on the ranks) or with several DP ranks, and
CUDA graphs for these layers (issue 38).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from actors.kernels.delta_rule import KERNELS

CACHE_METHODS = ("update_conv_state", "update_recurrent_state")
"""What a module's forward must call to keep its state through transformers' cache interface."""


def keeps_cache_state(module: nn.Module) -> bool:
    """Whether the module's forward keeps its per-sequence state through the cache interface
    (itself or through the functions of its modeling file it calls, as the short convolution)."""
    return _forward_keeps_state(type(module)) and isinstance(
        getattr(module, "layer_idx", None), int
    )


@functools.cache
def _forward_keeps_state(cls: type) -> bool:
    """The source test of `keeps_cache_state`, once per module class (every layer asks)."""
    forward = inspect.unwrap(cls.forward)
    home = sys.modules.get(forward.__module__)
    reached = [forward]
    for name in forward.__code__.co_names:
        found = getattr(home, name, None)
        # a function the `kernels` hub may swap for a kernel is an nn.Module calling it
        inner = (inspect.getclosurevars(type(found).forward).nonlocals.values()
                 if isinstance(found, nn.Module) else (found,))  # fmt: skip
        reached += [f for f in inner
                    if inspect.isfunction(f) and f.__module__ == forward.__module__]  # fmt: skip
    try:
        source = "".join(inspect.getsource(f) for f in reached)
    except (OSError, TypeError):
        return False
    return all(m in source for m in CACHE_METHODS)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes a state snapshot may hold, by their code in its header."""


class StatePool:
    """One row per state slot for every linear-attention layer of a stage: the convolution
    window and the recurrent state, each allocated at its first write (shape and dtype as the
    module gives them) and grown to the highest slot asked for.

    Snapshots (prefix caching for hybrids): `save` copies a slot's states of every layer into a
    snapshot row (the engine's, kept with the KV block whose last token they follow), `restore`
    copies a row back into a slot, `export` / `load` turn a row into one flat float32 tensor
    for the tiers and back."""

    def __init__(self) -> None:
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.snap_conv: dict[int, torch.Tensor] = {}
        self.snap_recurrent: dict[int, torch.Tensor] = {}
        self.layers: tuple[int, ...] = ()
        """The stage's linear-attention layers (set by `attach`): what a snapshot must hold."""

    def _pairs(self):
        return ((self.conv, self.snap_conv), (self.recurrent, self.snap_recurrent))

    def save(self, slot: int, row: int) -> None:
        """Snapshot row `row` := the states of state slot `slot` (every layer)."""
        at = torch.tensor([row])
        for live, snap in self._pairs():
            for layer, table in live.items():
                self.put(snap, layer, at.to(table.device), table[slot : slot + 1])

    def restore(self, row: int, slot: int) -> None:
        """State slot `slot` := snapshot row `row` (every layer)."""
        at = torch.tensor([slot])
        for live, snap in self._pairs():
            for layer, table in snap.items():
                self.put(live, layer, at.to(table.device), table[row : row + 1])

    def export(self, row: int) -> torch.Tensor:
        """Snapshot row `row` as one flat float32 tensor: a header (entries; then per entry its
        kind (0 conv, 1 recurrent), layer, dtype code, rank and sizes), then the values."""
        head: list[float] = []
        values: list[torch.Tensor] = []
        entries = [(kind, layer, snap[layer][row])
                   for kind, (_, snap) in enumerate(self._pairs()) for layer in sorted(snap)]  # fmt: skip
        head.append(len(entries))
        for kind, layer, t in entries:
            head += [kind, layer, _DTYPES.index(t.dtype), t.dim(), *t.shape]
            values.append(t.reshape(-1).float().cpu())
        return torch.cat([torch.tensor(head, dtype=torch.float32), *values])

    def load(self, row: int, flat: torch.Tensor, device: torch.device) -> None:
        """Snapshot row `row` := an `export`ed tensor; ValueError, the row untouched, when it is
        not one of this stage's (its layers, or its length, differ)."""
        flat = flat.reshape(-1).float()
        head = flat.tolist()
        at, entries = 1, []
        for _ in range(int(head[0]) if head else 0):
            kind, layer, code, rank = (int(v) for v in head[at : at + 4])
            shape = tuple(int(v) for v in head[at + 4 : at + 4 + rank])
            entries.append((kind, layer, _DTYPES[code], shape))
            at += 4 + rank
        for kind in (0, 1):
            if sorted(e[1] for e in entries if e[0] == kind) != sorted(self.layers):
                raise ValueError(f"a state snapshot for other layers than {self.layers}")
        if at + sum(math.prod(e[3]) for e in entries) != flat.numel():
            raise ValueError("a state snapshot of another length than its header says")
        at_row = torch.tensor([row], device=device)
        for kind, layer, dtype, shape in entries:
            n = math.prod(shape)
            value = flat[at : at + n].reshape(1, *shape).to(device, dtype)
            self.put(self._pairs()[kind][1], layer, at_row, value)
            at += n

    def put(self, table: dict[int, torch.Tensor], layer: int, slots: torch.Tensor, value):
        rows = int(slots.max()) + 1
        have = table.get(layer)
        if have is None or have.shape[0] < rows or have.shape[1:] != value.shape[1:]:
            grown = value.new_zeros((max(rows, 2 * (have.shape[0] if have is not None else 0)),
                                     *value.shape[1:]))  # fmt: skip
            if have is not None and have.shape[1:] == value.shape[1:]:
                grown[: have.shape[0]] = have
            table[layer] = have = grown
        have[slots] = value.to(have.dtype)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self._pairs() for d in pair
                   for t in d.values())  # fmt: skip


class SlotStates:
    """transformers' linear-attention cache interface for one group of sequences of one step:
    the states of `slots` (None where the group is fresh), taken back by `store` afterwards."""

    def __init__(self, pool: StatePool, layer: int, slots: torch.Tensor, fresh: bool) -> None:
        self.pool, self.layer, self.slots, self.fresh = pool, layer, slots, fresh
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        if not fresh:
            self.conv = pool.conv[layer][slots]  # a copy: decode updates it in place
            self.recurrent = pool.recurrent[layer][slots]

    # transformers 5.1x reads the states as cache.layers[i].conv_states[0] after asking
    # has_previous_state(i); 5.2x through get_conv_state / get_recurrent_state.
    @property
    def layers(self) -> dict[int, _LayerView]:
        return {self.layer: _LayerView(self)}

    def has_previous_state(
        self, layer_idx: int | None = None, state_idx: int | None = None
    ) -> bool:
        return not self.fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers counts a cache's tokens here; positions come from the step instead."""

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # only the last state of a chunk is kept (no snapshots within a step)

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The window the causal convolution reads (the kept state, then the new inputs, as
        transformers' LinearAttentionLayer returns it); its last kernel-size columns are kept."""
        k = conv_kernel_size or (self.conv.shape[-1] if self.conv is not None else None)
        if k is None:
            raise ValueError("update_conv_state needs conv_kernel_size for a fresh sequence")
        if self.conv is None:
            full = F.pad(conv_states, (max(0, k - conv_states.shape[-1]), 0))
        else:
            full = torch.cat([self.conv.to(conv_states.dtype), conv_states], dim=-1)
        self.conv = full[..., -k:]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states

    def store(self) -> None:
        if self.conv is not None:
            self.pool.put(self.pool.conv, self.layer, self.slots, self.conv)
        if self.recurrent is not None:
            self.pool.put(self.pool.recurrent, self.layer, self.slots, self.recurrent)


class _LayerView:
    """One layer of a SlotStates as transformers 5.1x reads it (`layers[i]`)."""

    record_past = False

    def __init__(self, states: SlotStates) -> None:
        self.conv_states = [states.conv]
        self.recurrent_states = [states.recurrent]


def native_kernels(module: nn.Module):
    """A context manager factory: within one of its contexts, the module's modeling file calls
    our gated delta rule (`actors.kernels.delta_rule`: torch on the CPU, Triton on CUDA) where
    it would call its own (the names of `KERNELS` it has, found once here). Its short
    convolution, gates, norms and projections stay transformers'."""
    home = sys.modules.get(type(module).__module__)
    theirs = {n: getattr(home, n) for n in KERNELS if home is not None and hasattr(home, n)}

    @contextlib.contextmanager
    def swapped():
        for name in theirs:
            setattr(home, name, KERNELS[name])
        try:
            yield
        finally:
            for name, function in theirs.items():
                setattr(home, name, function)

    return swapped


def cache_keyword(forward) -> str:
    """The name the module's forward takes its cache by (`cache` in 5.2x, `cache_params` before)."""
    params = inspect.signature(inspect.unwrap(forward)).parameters
    return "cache" if "cache" in params else "cache_params"


def groups(query_lens: Sequence[int], context_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """(decodes, alone): the sequences that continue by one token, run as one batch, and the
    others (fresh prompts, later prefill chunks), each run by itself."""
    decodes, alone = [], []
    for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        (decodes if q == 1 and c > 1 else alone).append(i)
    return decodes, alone


def mixed_forward(module: nn.Module, forward, pool: StatePool):
    """A forward for `module` (its own `forward`, bound) that, inside a stage step (a `paged`
    keyword with query/context lengths and state slots), runs each group of sequences over its
    states; outside one it is the module's own forward."""
    key = cache_keyword(forward)
    kernels = native_kernels(module)

    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        paged = kwargs.pop("paged", None)
        if paged is None:
            return forward(hidden_states, *args, **kwargs)
        kwargs.pop("cache", None)
        kwargs.pop("cache_params", None)
        kwargs.pop("attention_mask", None)
        slots_of = paged.state_slots
        q, c = paged.query_lens, paged.context_lens
        if len(slots_of) != len(q):
            raise RuntimeError(
                f"{type(module).__name__} (layer {module.layer_idx}) keeps a state per sequence; "
                f"the step gave {len(slots_of)} state slots for {len(q)} sequences"
            )
        x = hidden_states[0]
        starts = [0]
        for n in q:
            starts.append(starts[-1] + n)
        out = torch.empty_like(x)
        decodes, alone = groups(q, c)
        dev = x.device
        with kernels():
            if decodes:
                rows = torch.tensor([starts[i] for i in decodes], device=dev)
                slots = torch.tensor([slots_of[i] for i in decodes], device=dev)
                view = SlotStates(pool, module.layer_idx, slots, fresh=False)
                y = forward(x[rows][:, None], **{key: view}, **kwargs)
                view.store()
                out[rows] = y[:, 0].to(out.dtype)
            for i in alone:
                slots = torch.tensor([slots_of[i]], device=dev)
                view = SlotStates(pool, module.layer_idx, slots, fresh=c[i] == q[i])
                y = forward(x[starts[i] : starts[i + 1]][None], **{key: view}, **kwargs)
                view.store()
                out[starts[i] : starts[i + 1]] = y[0].to(out.dtype)
        return out[None]

    return run


def attach(layers: dict[int, nn.Module], pool: StatePool) -> None:
    """Route each linear-attention module (by layer index) through `mixed_forward`; the module
    keeps its parameters and names (its forward is replaced on the instance)."""
    pool.layers = tuple(sorted(layers))
    for module in layers.values():
        module.forward = mixed_forward(module, module.forward, pool)
