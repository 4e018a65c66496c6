"""Per-kernel table of an Nsight Compute CSV from `bench/ncu_decode.py` (issue #8, round 16).

    python3 bench/ncu_summary.py bench/results/gpu_round16/ncu_b1_1k.csv.gz

Kernels grouped by name: calls, us a call, DRAM MB a call, GB/s, the share of the DRAM peak ncu
reports, grid, block, registers a thread, active warps (% of the SM's peak); then the sums.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import sys
from collections import defaultdict
from pathlib import Path

TIME, BYTES = "gpu__time_duration.sum", "dram__bytes_read.sum"
PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
WARPS = "sm__warps_active.avg.pct_of_peak_sustained_active"


def kernels(path: Path) -> dict[int, dict]:
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
    rows = [r for r in csv.reader(io.StringIO(text)) if len(r) > 10]
    head, out = rows[0], defaultdict(dict)
    at = {name: head.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
    for r in rows[1:]:
        k = out[int(r[at["ID"]])]
        k["name"] = re.sub(r"\(.*", "", r[at["Kernel Name"]])[:40]
        value = r[at["Metric Value"]].replace(",", "")
        k[r[at["Metric Name"]]] = float(value) if value else 0.0
    return out


def table(path: Path) -> str:
    groups: dict[str, list[dict]] = defaultdict(list)
    ks = kernels(path)
    for i in sorted(ks):
        groups[ks[i]["name"]].append(ks[i])
    lines = [f"{'kernel':40s} {'n':>4s} {'us':>8s} {'MB':>8s} {'GB/s':>6s} {'dram%':>6s} "
             f"{'grid':>6s} {'block':>5s} {'regs':>4s} {'warps%':>6s}"]  # fmt: skip
    order = sorted(groups.items(), key=lambda kv: -sum(k[TIME] for k in kv[1]))
    for name, g in order:
        n, t, b = len(g), sum(k[TIME] for k in g), sum(k[BYTES] for k in g)
        last = g[-1]
        lines.append(
            f"{name:40s} {n:4d} {t / n / 1e3:8.2f} {b / n / 1e6:8.2f} {b / t:6.0f} "
            f"{sum(k[PCT] for k in g) / n:6.1f} {last['launch__grid_size']:6.0f} "
            f"{last['launch__block_size']:5.0f} {last['launch__registers_per_thread']:4.0f} "
            f"{sum(k[WARPS] for k in g) / n:6.1f}"
        )
    t, b = sum(k[TIME] for k in ks.values()), sum(k[BYTES] for k in ks.values())
    lines.append(
        f"{len(ks)} kernels, {t / 1e3:.1f} us, {b / 1e6:.1f} MB of DRAM reads, {b / t:.0f} GB/s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg)
        print(table(Path(arg)))
