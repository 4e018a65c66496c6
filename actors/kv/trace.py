"""Time points of KVTiers' batched calls (actors/kv/offload.py): `Marks` records them (host
clock and timing CUDA events) into `TierIO.trace` when the caller set it to a dict (None, the
default: nothing is recorded); `split_ms` turns one call's points into milliseconds.

Besides the fixed points (start, first_copy, copies_done, verified, end) a call may mark any
other name: a store marks, per put batch i, `seen{i}` (the host saw its rows landed) and
`put{i}` (its put returned), per piece c `landed{c}` (a timing event after its copy), and
`launched`, `puts_done`, `closed` (the phases after the copies). The garbage collector's
collections during the call are counted (`gc_collections`, `gc_ms`; the latest traced call of
the process counts them)."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

FIXED = ("start", "first_copy", "copies_done", "verified", "end")


def split_ms(trace: dict) -> dict:
    """One call's time points (`Marks`) as ms: "all" (host, start to end); with CUDA also
    "before_first_copy" (the device idle before the first copy), "copies" (first copy start to
    the last copy's end), "after_copies_on_device" (verification that followed), and
    "host_after_device" (host time after the device's last event). Every other point as
    "<name>_ms": relative to the end of the last copy on the device (CUDA; host points placed on
    the device's clock by assuming the start event ran when the host recorded it, as
    host_after_device does; negative: before it), else to the start."""
    t0, start = trace["start"]
    out = {"all": 1e3 * (trace["end"][0] - t0)}
    if "gc" in trace:
        out["gc_collections"], out["gc_ms"] = trace["gc"][0], 1e3 * trace["gc"][1]
    extra = [k for k in trace if k not in FIXED and k != "gc"]
    if start is None or "first_copy" not in trace:
        out.update({f"{k}_ms": 1e3 * (trace[k][0] - t0) for k in extra})
        return out
    first, done = trace["first_copy"][1], trace["copies_done"][1]
    last = trace.get("verified", trace["copies_done"])[1]
    last.synchronize()
    done.synchronize()
    out["before_first_copy"] = start.elapsed_time(first)
    out["copies"] = first.elapsed_time(done)
    out["after_copies_on_device"] = max(0.0, done.elapsed_time(last))
    out["host_after_device"] = out["all"] - start.elapsed_time(last)
    at_done = start.elapsed_time(done)
    for k in extra:
        host, event = trace[k]
        if event is not None:
            event.synchronize()
            out[f"{k}_ms"] = start.elapsed_time(event) - at_done
        else:
            out[f"{k}_ms"] = 1e3 * (host - t0) - at_done
    return out


class Marks:
    """Time points of one call into `trace` (a dict, or None: nothing recorded): name -> (host
    perf_counter seconds, a timing CUDA event recorded on the given stream or None)."""

    def __init__(self, trace: dict | None, device: torch.device | None) -> None:
        self.trace = trace
        self._gc: list[float] = []
        if trace is not None:
            trace.clear()
            trace["gc"] = [0, 0.0]
            # A call that raised never reached "end": its callback goes now (at most one stays).
            gc.callbacks[:] = [c for c in gc.callbacks if not isinstance(
                getattr(c, "__self__", None), Marks)]  # fmt: skip
            gc.callbacks.append(self._on_gc)
            self.mark("start", None if device is None else torch.cuda.current_stream(device))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc.append(time.perf_counter())
        elif self._gc and self.trace is not None:
            self.trace["gc"][0] += 1
            self.trace["gc"][1] += time.perf_counter() - self._gc.pop()

    @property
    def on(self) -> bool:
        return self.trace is not None

    def mark(self, name: str, stream: Any = None) -> None:
        if self.trace is None:
            return
        event = None
        if stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        self.trace[name] = (time.perf_counter(), event)
        if name == "end" and self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
