"""A CPU runner's adaptive torch thread count (`ThreadTuner`; the runner's `ADAPT_THREADS`
switches it, `MOE_CPU_ADAPT_THREADS=0` turns it off)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from actors.executor.step import StepInput


class ThreadTuner:
    """A CPU runner's torch thread count from its timed decode steps: with N > 1 set, now and then
    `trial` steps run at the other count (1 or N), kept if its median time a token is `margin` x
    lower; a prefill runs at the kept one. On shared cores N threads wait for a descheduled peer
    (one of 2 busy: decode 2.7x slower at 2 than at 1), on quiet ones N are faster. A losing
    trial doubles the gap to the next (`first` to `longest` steps). Batch-invariant steps stay:
    on some CPUs (seen on an AMD EPYC host) a GEMM of a few rows (5-7) rounds differently at 1
    and 2 threads, so a batched engine's values can move in their last bits with the machine's
    timing; a batch-invariant one's do not."""

    trial, first, longest, margin = 5, 8, 256, 0.9

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock, self.base, self.cur, self.t0 = clock, 0, 0, 0.0
        self.gap = self.left = self.first  # steps between trials, left before the next
        self.ref: list[float] = []  # per-token times of the latest steps at `cur`
        self.tried: list[float] | None = None  # of this trial's steps (None: no trial now)

    def start(self, step: StepInput) -> bool:
        """Before `step`; whether it is timed: decode, not batch invariant (bits must not move)."""
        if max(step.query_lens) > 1 or step.per_sequence:
            if self.tried is not None:  # at `cur`, no trial
                self.tried = None
                torch.set_num_threads(self.cur)
            return False
        want = self.cur if self.tried is None else self.base + 1 - self.cur
        if torch.get_num_threads() != want or not self.base:  # first step, or set from outside
            self.base = self.cur = torch.get_num_threads()
            self.gap, self.left, self.ref, self.tried = self.first, self.first, [], None
        self.t0 = self.clock()
        return True

    def stop(self, tokens: int) -> None:
        per = (self.clock() - self.t0) / max(tokens, 1)
        if self.base < 2:
            return
        if self.tried is None:
            self.ref = [*self.ref[1 - self.trial :], per]
            self.left -= 1
            if self.left <= 0 and len(self.ref) == self.trial:
                self.tried = []
                torch.set_num_threads(self.base + 1 - self.cur)
            return
        self.tried.append(per)
        if len(self.tried) < self.trial:
            return
        if statistics.median(self.tried) < self.margin * statistics.median(self.ref):
            self.cur, self.gap = self.base + 1 - self.cur, self.first
        else:
            self.gap = min(2 * self.gap, self.longest)
        torch.set_num_threads(self.cur)
        self.left, self.ref, self.tried = self.gap, [], None
