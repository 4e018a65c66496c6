"""The nccl-tests wrapper: parse `*_perf` output of any version, run the binaries where present.

Bus bandwidth follows nccl-tests' PERFORMANCE.md: algbw = size / time, and busbw = algbw x a
per-operation factor that makes it comparable to the hardware's peak link bandwidth:
all_reduce 2(n-1)/n; all_gather, reduce_scatter, alltoall (n-1)/n; broadcast, reduce, sendrecv 1.

Parsed output (`NcclRun.to_json()`):
    {"op", "ranks", "rows": [{"size", "count", "type", "redop", "root", "time_us", "algbw_GBps",
     "busbw_GBps", "wrong", "error", "inplace_time_us", "inplace_algbw_GBps",
     "inplace_busbw_GBps", "inplace_wrong", "inplace_error"}], "avg_busbw_GBps",
     "complete", "errors": [{"line", "text"}], "warnings": [{"line", "text"}], "skipped"}
`wrong` is None where the run printed N/A (validation off) or used the legacy `error` column,
whose float lands in `error`. `root` is None in the legacy format.

What nccl-tests wrote and what the launcher interleaved: inside the results table (after its
header) a line is one of
- a data row: it starts with an integer and at least half of its cells are numbers (size,
  count, times, bandwidths, #wrong; `N/A` counts as one). A data row that does not parse, or is
  cut short, is a malformed row: bad input when good rows follow it, else the run's failure;
- a comment (`#`, the footer), or a failure line (CUDA/NCCL errors, kills, exit codes): errors;
- launcher noise, skipped and counted in `skipped`: MPI help messages (the text between two
  `-----` banners and the banners, `[host:pid] N more processes have sent help message ...`,
  `Set MCA parameter ...`), `srun:` status lines, and any other text that is none of these
  (MPI, UCX, NCCL warnings ...: also listed in `warnings`). Launcher prefixes (srun ` 0: `,
  Open MPI `[1,0]<stdout>:`, Ray `(head, rank=0, pid=...)`) are stripped from every line first.
A fatal line inside a help message (a process killed, terminated, an exit code) is still an
error.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field

from cluster.errors import EnvironmentMissing, InputError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "reduce", "sendrecv")

# Launcher prefixes: srun ` 0: `, Open MPI `[1,0]<stdout>:`, Ray `(head, rank=0, pid=3808) `.
_PREFIXES = (
    re.compile(r"^\(.*?pid=\d+\)\s?"),
    re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:\s?"),
    re.compile(r"^\s*\d+:(?=\s|$)\s?"),
)
_RANK_LINE = re.compile(r"^#\s*Rank\s+(\d+)\b")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([\d.eE+-]+)")
_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s*(\w+)")
_OP_NAME = re.compile(r"\b(" + "|".join(OPS) + r")_perf\b")
_FAILURE = re.compile(
    r"(?i)fail|error|abort|terminat|segmentation|illegal|signal|killed|timeout|exit code"
)
_FATAL = re.compile(r"(?i)abort|terminat|segmentation|signal \d|killed|exit(ed)? (code|on)")
"""Failure words that count even inside an MPI help message (help text says 'error' freely)."""
_WARNING = re.compile(r"(?i)warn")
_HELP_BANNER = re.compile(r"^-{20,}$")
_LAUNCHER_LINE = re.compile(
    r"(?i)^(\[[^\]]*\]\s*)?(\d+ more process(es)? ha(s|ve) sent help message"
    r"|set mca parameter)|^srun: (?!error)"
)
_NUMBER = re.compile(r"^(-?\d+(\.\d*)?([eE][+-]?\d+)?|N/A)$")


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw for `op` over `ranks` ranks (nccl-tests PERFORMANCE.md)."""
    n = ranks
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise InputError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


@dataclass(frozen=True, kw_only=True)
class NcclRow:
    """One message size. Bytes, microseconds, 10^9 B/s."""

    size: int
    count: int
    type: str
    redop: str | None
    root: int | None
    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int | None
    error: float | None = None
    inplace_time_us: float | None = None
    inplace_algbw_GBps: float | None = None
    inplace_busbw_GBps: float | None = None
    inplace_wrong: int | None = None
    inplace_error: float | None = None


@dataclass(frozen=True, kw_only=True)
class NcclRun:
    op: str | None
    ranks: int | None
    rows: tuple[NcclRow, ...]
    avg_busbw_GBps: float | None
    complete: bool
    errors: tuple[dict, ...] = field(default=())
    warnings: tuple[dict, ...] = field(default=())
    skipped: int = 0
    """Lines inside the results table that nccl-tests did not write (launcher help messages,
    warnings, other interleaved text; see the module docstring), skipped."""

    @property
    def total_wrong(self) -> int:
        return sum((r.wrong or 0) + (r.inplace_wrong or 0) for r in self.rows)

    def to_json(self) -> dict:
        data = asdict(self)
        data["errors"] = list(self.errors)
        data["warnings"] = list(self.warnings)
        data["rows"] = [asdict(r) for r in self.rows]
        return data


def strip_prefix(line: str) -> str:
    """The line without a launcher prefix (each prefix kind applied at most once, in order)."""
    for pattern in _PREFIXES:
        line = pattern.sub("", line, count=1)
    return line


def _header_columns(line: str) -> list[str] | None:
    tokens = line.lstrip("#").split()
    if tokens[:3] == ["size", "count", "type"] and "time" in tokens:
        return tokens
    return None


def _is_data_row(tokens: list[str]) -> bool:
    """A line nccl-tests printed as a table row, well formed or not: an integer first and at
    least half of the cells numbers (launcher text is mostly words, also when it starts with a
    count, as in `7 more processes have sent help message ...`)."""
    if not tokens or not tokens[0].isdigit():
        return False
    return 2 * sum(1 for t in tokens if _NUMBER.match(t)) >= len(tokens)


def _row(tokens: list[str], columns: list[str]) -> NcclRow:
    """A row from tokens laid out as `columns`; ValueError when a cell does not parse."""
    values: dict[str, object] = {}
    groups = 0
    for name, tok in zip(columns, tokens, strict=True):
        if name == "time":
            groups += 1
        prefix = "inplace_" if groups == 2 else ""
        if name == "size":
            values["size"] = int(tok)
        elif name == "count":
            values["count"] = int(tok)
        elif name == "type":
            if not re.fullmatch(r"[A-Za-z][\w]*", tok):
                raise ValueError(tok)
            values["type"] = tok
        elif name == "redop":
            values["redop"] = tok
        elif name == "root":
            values["root"] = int(tok)
        elif name == "time":
            values[prefix + "time_us"] = float(tok)
        elif name == "algbw":
            values[prefix + "algbw_GBps"] = float(tok)
        elif name == "busbw":
            values[prefix + "busbw_GBps"] = float(tok)
        elif name in ("#wrong", "wrong"):
            values[prefix + "wrong"] = None if tok == "N/A" else int(tok)
        elif name == "error":
            values[prefix + "error"] = None if tok == "N/A" else float(tok)
    values.setdefault("redop", None)
    values.setdefault("root", None)
    values.setdefault("wrong", None)
    return NcclRow(**values)


def parse_nccl_tests(
    text: str, *, origin: str = "nccl-tests output", op: str | None = None
) -> NcclRun:
    """Parse the output of one nccl-tests run; InputError (naming the line) if it is not one.

    A run that stopped mid-table keeps its complete rows and reports `complete=False` with the
    lines that follow; a garbled row followed by more good rows is bad input. Launcher lines
    interleaved with the table are skipped and counted (`skipped`, see the module docstring).
    """
    lines = [strip_prefix(ln.rstrip("\r\n")) for ln in text.splitlines()]
    # Step 1: preamble facts: the op (from a command echo or `Collective test starting`), ranks.
    ranks: set[int] = set()
    for line in lines:
        m = _RANK_LINE.match(line.strip())
        if m:
            ranks.add(int(m.group(1)))
        if op is None:
            found = _OP_NAME.search(line)
            op = found.group(1) if found else None
    # Step 2: the table header, then data rows, comments, warnings and failures.
    columns: list[str] | None = None
    rows: list[NcclRow] = []
    bad: list[tuple[int, str]] = []
    errors: list[dict] = []
    warnings: list[dict] = []
    avg = None
    footer = False
    in_help = False
    skipped = 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if columns is None:
            if stripped.startswith("#"):
                columns = _header_columns(stripped)
            continue
        if not stripped:
            continue
        if _HELP_BANNER.match(stripped):
            in_help, skipped = not in_help, skipped + 1
            continue
        if stripped.startswith("#"):
            m = _AVG.match(stripped)
            if m:
                avg, footer = float(m.group(1)), True
            m = _OOB.match(stripped)
            if m and (int(m.group(1)) != 0 or m.group(2) != "OK"):
                errors.append({"line": number, "text": stripped})
            continue
        tokens = stripped.split()
        if _is_data_row(tokens) and not footer:
            cells = tokens
            if len(tokens) > len(columns) and tokens[len(columns)].startswith("#"):
                cells = tokens[: len(columns)]
            try:
                row = _row(cells, columns)
            except (ValueError, TypeError):
                bad.append((number, stripped))
                errors.append({"line": number, "text": stripped})
                continue
            if bad:
                first = bad[0]
                raise InputError(
                    f"{origin}: line {first[0]}: malformed row ({len(first[1].split())} cells, "
                    f"expected {len(columns)}: {' '.join(columns)})"
                )
            rows.append(row)
        elif in_help or _LAUNCHER_LINE.search(stripped):
            if _FATAL.search(stripped):
                errors.append({"line": number, "text": stripped})
            else:
                skipped += 1
        elif _FAILURE.search(stripped) and not _WARNING.search(stripped):
            errors.append({"line": number, "text": stripped})
        else:
            skipped += 1
            warnings.append({"line": number, "text": stripped})
    if columns is None:
        raise InputError(
            f"{origin}: no nccl-tests table header ('# size count type ... time algbw busbw') found"
        )
    complete = footer and not errors
    return NcclRun(
        op=op,
        ranks=max(ranks) + 1 if ranks else None,
        rows=tuple(rows),
        avg_busbw_GBps=avg,
        complete=complete,
        errors=tuple(errors),
        warnings=tuple(warnings),
        skipped=skipped,
    )


# ---- running the binaries ----------------------------------------------------------------------
def binary_for(op: str) -> str | None:
    """Path of `<op>_perf` on PATH, or None."""
    return shutil.which(f"{op}_perf")


def run_nccl_tests(
    op: str,
    *,
    min_bytes: int,
    max_bytes: int,
    gpus: int,
    iters: int = 20,
    warmup: int = 5,
    timeout_s: float = 600,
) -> NcclRun:
    """Run `<op>_perf -b min -e max -f 2 -g gpus` (one process, all local GPUs) and parse it."""
    exe = binary_for(op)
    if exe is None:
        raise EnvironmentMissing(f"{op}_perf is not on PATH (build NVIDIA/nccl-tests)")
    cmd = [
        exe,
        "-b",
        str(min_bytes),
        "-e",
        str(max_bytes),
        "-f",
        "2",
        "-g",
        str(gpus),
        "-n",
        str(iters),
        "-w",
        str(warmup),
        "-c",
        "1",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise EnvironmentMissing(f"{' '.join(cmd)} did not finish in {timeout_s:.0f} s") from exc
    return parse_nccl_tests(done.stdout + done.stderr, origin=" ".join(cmd), op=op)
