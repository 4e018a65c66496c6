"""Parse `nvidia-smi topo -m` text into a node's devices and link matrix.

The format (as printed by many driver generations, see tests/cluster/test_smi_topo.py):

    <tab>GPU0<tab>GPU1<tab>NIC0<tab>CPU Affinity<tab>NUMA Affinity<tab>GPU NUMA ID
    GPU0<tab> X <tab>NV18<tab>PIX<tab>0-47<tab>0<tab><tab>N/A
    ...
    NIC0<tab>PIX<tab>NODE<tab> X <tab><tab>
    Legend: ...
    NIC Legend:
      NIC0: mlx5_0

- Raw output uses tabs (the header starts with a tab, GPU rows may carry an extra empty field
  before `GPU NUMA ID`); terminal copies align with spaces, where a blank cell is just absent.
- NIC columns are either named directly (`mlx5_0`) or `NIC0..` with a `NIC Legend:` block;
  here every NIC becomes `NIC{k}` (order of the columns) and keeps its device name.
- NIC rows carry no affinity cells. ANSI escape codes (with or without the ESC byte) may wrap
  the header; any text before the header (`NVIDIA Topology:`, a command echo) is skipped.
- Cells: X (self), NV# (# bonded NVLinks), PIX, PXB, PHB, NODE, SYS (older drivers: SOC).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.errors import InputError

_ANSI = re.compile(r"\x1b?\[[0-9;]*m")
_CELL = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
_MULTIWORD = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_LEGEND_NIC = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_GPU = re.compile(r"^GPU\d+$")
_NICN = re.compile(r"^NIC\d+$")


@dataclass(frozen=True, kw_only=True)
class SmiDevice:
    """One row of the matrix: `id` is GPU{i} or NIC{k}; affinities as printed (None if blank)."""

    id: str
    name: str | None
    cpu_affinity: str | None = None
    numa_affinity: str | None = None
    gpu_numa_id: str | None = None

    @property
    def numa_node(self) -> int | None:
        """The NUMA node when the affinity names exactly one."""
        value = self.numa_affinity
        return int(value) if value is not None and value.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class SmiTopo:
    """Parsed `nvidia-smi topo -m`: devices in matrix order and the path code of each pair."""

    gpus: tuple[SmiDevice, ...]
    nics: tuple[SmiDevice, ...]
    paths: dict[tuple[str, str], str]
    """(a, b) -> `NV18` | PIX | PXB | PHB | NODE | SYS, for a < b in matrix order (row a's cell)."""


def _columns(header: str) -> list[tuple[str, int]]:
    """Header columns with their character offsets (multi-word names kept whole)."""
    masked = header
    for name in _MULTIWORD:
        masked = masked.replace(name, name.replace(" ", "\0"))
    return [(m.group().replace("\0", " "), m.start()) for m in re.finditer(r"[^\s]+", masked)]


def _find_header(lines: list[str]) -> int:
    """The first line starting with GPU0 whose next non-blank line is the GPU0 row."""
    for i, line in enumerate(lines):
        tokens = line.split()
        if not tokens or tokens[0] != "GPU0":
            continue
        following = next((ln for ln in lines[i + 1 :] if ln.strip()), "")
        if following.split()[:1] == ["GPU0"]:
            return i
    raise InputError(
        "nvidia-smi topo: no header row starting with GPU0 followed by a GPU0 row was found"
    )


def parse_smi_topo(text: str, *, origin: str = "nvidia-smi topo -m") -> SmiTopo:
    """Parse the text; InputError naming the line number on malformed input."""
    lines = [_ANSI.sub("", ln).rstrip("\r\n") for ln in text.splitlines()]
    # Step 1: the header row and its columns; device columns come before the attribute ones.
    h = _find_header(lines)
    columns = _columns(lines[h])
    n_dev = 0
    for name, _ in columns:
        if name in _MULTIWORD:
            break
        n_dev += 1
    devices = [c for c, _ in columns[:n_dev]]
    attrs = columns[n_dev:]
    if len(set(devices)) != len(devices):
        raise InputError(f"{origin}: line {h + 1}: a device column repeats in the header")
    # Step 2: the rows, until a blank line or the legend.
    rows: dict[str, tuple[int, list[str], dict[str, str | None]]] = {}
    end = h + 1
    for i in range(h + 1, len(lines)):
        line = lines[i]
        if not line.strip() or line.strip().startswith("Legend"):
            break
        end = i + 1
        label, cells, values = _row(line, i + 1, devices, attrs, origin)
        if label in rows:
            raise InputError(f"{origin}: line {i + 1}: row {label} appears twice")
        rows[label] = (i + 1, cells, values)
    missing = [d for d in devices if d not in rows]
    if missing:
        raise InputError(
            f"{origin}: line {end + 1}: the table ends before the row of {missing[0]} "
            f"({len(rows)} of {len(devices)} rows)"
        )
    # Step 3: the NIC legend (NICk: name), anywhere after the table.
    legend = {}
    for line in lines[end:]:
        m = _LEGEND_NIC.match(line)
        if m:
            legend[m.group(1)] = m.group(2)
    # Step 4: ids (GPU{i}, NIC{k} in column order), paths from each row's upper-triangle cells.
    ids: dict[str, str] = {}
    gpus: list[SmiDevice] = []
    nics: list[SmiDevice] = []
    for col in devices:
        _, _, values = rows[col]
        if _GPU.match(col):
            ids[col] = f"GPU{len(gpus)}"
            gpus.append(SmiDevice(id=ids[col], name=None, **values))
        else:
            ids[col] = f"NIC{len(nics)}"
            name = legend.get(col, col) if _NICN.match(col) else col
            nics.append(SmiDevice(id=ids[col], name=name))
    paths: dict[tuple[str, str], str] = {}
    for a_pos, a in enumerate(devices):
        _, cells, _ = rows[a]
        for b_pos in range(a_pos + 1, len(devices)):
            paths[(ids[a], ids[devices[b_pos]])] = cells[b_pos]
    return SmiTopo(gpus=tuple(gpus), nics=tuple(nics), paths=paths)


def _row(
    line: str, line_no: int, devices: list[str], attrs: list[tuple[str, int]], origin: str
) -> tuple[str, list[str], dict[str, str | None]]:
    label = line.split()[0]
    if label not in devices:
        raise InputError(
            f"{origin}: line {line_no}: row {label!r} is not a device column of the header "
            f"({', '.join(devices)})"
        )
    # Step 1: the matrix cells are the first len(devices) tokens after the label.
    cells: list[str] = []
    pos = line.index(label) + len(label)
    pos_end = pos
    for m in re.finditer(r"\S+", line[pos:]):
        if len(cells) == len(devices):
            break
        cell = m.group()
        if not _CELL.match(cell):
            col = devices[len(cells)]
            raise InputError(
                f"{origin}: line {line_no}: cell {cell!r} (row {label}, column {col}) is not "
                f"X, NV#, PIX, PXB, PHB, NODE or SYS"
            )
        cells.append("SYS" if cell == "SOC" else cell)
        pos_end = pos + m.end()
    if len(cells) < len(devices):
        raise InputError(
            f"{origin}: line {line_no}: row {label} has {len(cells)} cells, expected {len(devices)}"
        )
    me = devices.index(label)
    for k, cell in enumerate(cells):
        if (cell == "X") != (k == me):
            raise InputError(
                f"{origin}: line {line_no}: row {label} column {devices[k]}: {cell!r} "
                f"(X only on the diagonal)"
            )
    # Step 2: the attribute cells (affinities), by tab field or by header offset.
    values = _attributes(line[pos_end:], pos_end, attrs)
    keys = {"CPU Affinity": "cpu_affinity", "NUMA Affinity": "numa_affinity"}
    keys["GPU NUMA ID"] = "gpu_numa_id"
    out = {keys[name]: values.get(name) for name in keys if name in dict(attrs)}
    return label, cells, out


def _attributes(rest: str, offset: int, attrs: list[tuple[str, int]]) -> dict[str, str | None]:
    names = [name for name, _ in attrs]
    tokens = [(m.group(), offset + m.start()) for m in re.finditer(r"\S+", rest)]
    blank = {n: None for n in names}
    if not tokens:
        return blank
    if len(tokens) == len(names):
        return {**blank, **dict(zip(names, (t for t, _ in tokens), strict=True))}
    if "\t" in rest:
        # Raw output: one field per column, plus a stray empty field before `GPU NUMA ID`.
        fields = [f.strip() for f in rest.split("\t")][1:]
        while len(fields) > len(names) and "" in fields[:-1]:
            drop = max(i for i, f in enumerate(fields[:-1]) if f == "")
            fields.pop(drop)
        fields = (fields + [""] * len(names))[: len(names)]
        return {n: (f or None) for n, f in zip(names, fields, strict=True)}
    # Space-aligned: each value belongs to the column whose header starts nearest to it.
    out = dict(blank)
    for token, start in tokens:
        nearest = min(attrs, key=lambda a: abs(a[1] - start))[0]
        out[nearest] = token if out[nearest] is None else f"{out[nearest]} {token}"
    return out
