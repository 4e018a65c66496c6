"""nccl-tests output parsing (every real fixture, our own prefixed variants) and bus factors.

Expected numbers are copied from the fixture text (the independent source), and busbw/algbw
ratios are checked against the formulas in nccl-tests' PERFORMANCE.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.errors import InputError
from cluster.nccl_tests import bus_factor, parse_nccl_tests, strip_prefix

DATA = Path(__file__).resolve().parent.parent / "data"


def _read(shared_dir, name):
    return (shared_dir / "fixtures" / "nccl" / name).read_text()


def _check_busbw(run, op):
    """Every row's busbw = algbw x factor (within the 2-decimal rounding of the printout)."""
    factor = bus_factor(op, run.ranks)
    for r in run.rows:
        if r.algbw_GBps >= 1:
            assert r.busbw_GBps == pytest.approx(r.algbw_GBps * factor, abs=0.02, rel=0.002)


def test_bus_factors_follow_nccl_tests_formulas():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 16) == 15 / 16
    assert bus_factor("alltoall", 4) == 3 / 4
    assert bus_factor("sendrecv", 2) == 1
    with pytest.raises(InputError):
        bus_factor("allreduce", 2)


def test_a100_v2_19_format(shared_dir):
    run = parse_nccl_tests(_read(shared_dir, "a100_sxm4_8x_1node_all_reduce_nccltests_v2_19_4.txt"))
    assert (run.op, run.ranks, len(run.rows), run.complete) == ("all_reduce", 8, 25, True)
    last = run.rows[-1]
    assert (last.size, last.count, last.type, last.redop, last.root) == (
        134217728,
        33554432,
        "float",
        "sum",
        -1,
    )
    assert (last.time_us, last.algbw_GBps, last.busbw_GBps, last.wrong) == (
        1295.41,
        103.61,
        181.32,
        0,
    )
    assert (last.inplace_time_us, last.inplace_busbw_GBps, last.inplace_wrong) == (
        1284.21,
        182.90,
        0,
    )
    assert run.avg_busbw_GBps == 34.9024
    _check_busbw(run, "all_reduce")


def test_srun_prefix_and_na_wrong(shared_dir):
    run = parse_nccl_tests(
        _read(shared_dir, "h100_16x_2node_ib_all_reduce_srun_prefix_nccltests290.txt")
    )
    assert run.ranks == 16 and len(run.rows) == 11 and run.complete
    assert (
        run.rows[0].size == 8388608
        and run.rows[0].wrong is None
        and run.rows[0].inplace_wrong is None
    )
    assert run.rows[-1].time_us == 103530
    assert run.avg_busbw_GBps == 142.735
    _check_busbw(run, "all_reduce")


def test_h100_single_node(shared_dir):
    run = parse_nccl_tests(_read(shared_dir, "h100_8x_1node_all_reduce_nccltests290.txt"))
    assert run.ranks == 8 and len(run.rows) == 6 and run.avg_busbw_GBps == 439.369
    assert run.rows[-1].inplace_busbw_GBps == 476.53
    _check_busbw(run, "all_reduce")


def test_gke_all_gather_with_nccl_version_line(shared_dir):
    run = parse_nccl_tests(
        _read(shared_dir, "h200_16x_2node_gke_rdma_all_gather_raw.txt"), op="all_gather"
    )
    assert run.ranks == 16 and len(run.rows) == 24 and run.complete
    assert run.rows[0].redop == "none" and run.rows[0].count == 16
    _check_busbw(run, "all_gather")


def test_run_that_failed_mid_row(shared_dir):
    run = parse_nccl_tests(_read(shared_dir, "h800_16x_2node_alltoall_cuda_error_nccltests355.txt"))
    assert run.op == "alltoall" and run.ranks == 16
    assert run.rows == () and run.complete is False
    assert run.errors[0]["line"] == 28 and "illegal memory access" in run.errors[0]["text"]
    assert len(run.errors) == 7


def test_legacy_error_column(shared_dir):
    run = parse_nccl_tests(
        _read(shared_dir, "v100_pcie_4x_1node_all_reduce_legacy_2019_format_error_col.txt")
    )
    assert run.ranks == 4 and len(run.rows) == 25 and run.complete
    first = run.rows[0]
    assert first.root is None and first.wrong is None
    assert first.error == 1e-07 and first.inplace_error == 0.0
    assert run.rows[-1].time_us == 18003
    _check_busbw(run, "all_reduce")


def test_every_shared_nccl_fixture_parses(shared_dir):
    for path in sorted((shared_dir / "fixtures" / "nccl").glob("*.txt")):
        run = parse_nccl_tests(path.read_text(), origin=path.name)
        assert run.ranks and (run.rows or not run.complete), path.name


def test_openmpi_prefix_warnings_and_comments():
    run = parse_nccl_tests((DATA / "nccl_openmpi_prefix_alltoall_4rank.txt").read_text())
    assert (run.op, run.ranks, run.complete) == ("alltoall", 4, True)
    assert [r.size for r in run.rows] == [1024, 2048, 4096, 8192]
    assert run.rows[3].wrong == 2 and run.total_wrong == 2
    assert len(run.warnings) == 1 and "UCX  WARN" in run.warnings[0]["text"]


def test_ray_prefix_run_cut_mid_row_keeps_full_rows():
    run = parse_nccl_tests((DATA / "nccl_ray_prefix_sendrecv_cut.txt").read_text(), op="sendrecv")
    assert run.ranks == 2 and run.complete is False
    assert [r.size for r in run.rows] == [1048576]
    assert [e["line"] for e in run.errors] == [7, 8]


def test_prefixes_are_stripped():
    assert strip_prefix(" 0: # Avg bus bandwidth") == "# Avg bus bandwidth"
    assert strip_prefix("[1,3]<stdout>:     1024") == "    1024"
    assert strip_prefix("(head, rank=0, pid=3808) [1,0]<stdout>:#  Rank") == "#  Rank"


def test_garbled_row_in_the_middle_is_bad_input(shared_dir):
    text = _read(shared_dir, "h100_8x_1node_all_reduce_nccltests290.txt")
    broken = text.replace("1139.2  235.63", "1139.2  2x5.63", 1)
    with pytest.raises(InputError, match="line 18: malformed row"):
        parse_nccl_tests(broken)


def test_text_without_a_table_is_bad_input():
    with pytest.raises(InputError, match="no nccl-tests table header"):
        parse_nccl_tests("hello\nworld\n")


MPI_HELP = "nccl_mpi_help_between_rows_allreduce.txt"
"""Our own fixture: an all_reduce table over 4 ranks with Open MPI help messages (banners,
`[host:pid] N more processes have sent help message`, `Set MCA parameter`, a bare `2 more
processes ...`), a UCX warning and an srun status line between the rows: 16 non-blank launcher
lines inside the table, 13 data rows."""
MPI_HELP_SIZES = [8 * 4**i for i in range(13)]


def test_launcher_lines_between_rows_are_skipped_and_counted():
    text = (DATA / MPI_HELP).read_text()
    run = parse_nccl_tests(text)
    assert (run.op, run.ranks, run.complete, run.errors) == ("all_reduce", 4, True, ())
    assert [r.size for r in run.rows] == MPI_HELP_SIZES
    assert run.rows[-1].busbw_GBps == 221.53 and run.rows[-1].inplace_wrong == 0
    assert run.skipped == 16
    assert [w["text"].split()[-1] for w in run.warnings] == ["available"]  # the UCX line
    assert run.to_json()["skipped"] == 16
    _check_busbw(run, "all_reduce")


def test_launcher_lines_with_srun_and_openmpi_prefixes():
    """The same output as srun -l (every line ` 0: `) and as mpirun --tag-output would tag it
    (the table on [1,0]<stdout>, the help messages on [1,0]<stderr>)."""
    text = (DATA / MPI_HELP).read_text()
    srun = "".join(f" 0: {line}\n" for line in text.splitlines())
    tagged = "".join(
        f"[1,0]<{'stdout' if line.startswith(('#', ' ')) else 'stderr'}>:{line}\n"
        for line in text.splitlines()
    )
    for variant in (srun, tagged):
        run = parse_nccl_tests(variant)
        assert [r.size for r in run.rows] == MPI_HELP_SIZES
        assert run.complete and run.skipped == 16


def test_malformed_numeric_row_among_launcher_lines_is_still_refused():
    text = (DATA / MPI_HELP).read_text()
    broken = text.replace("2.30    3.46", "2.30    3x46", 1)  # the 32768-byte row
    with pytest.raises(InputError, match="line 34: malformed row"):
        parse_nccl_tests(broken)
    count = text.replace("8388608       2097152", "8388608       20971x2", 1)
    with pytest.raises(InputError, match="malformed row"):
        parse_nccl_tests(count)


def test_a_fatal_line_inside_a_help_message_is_an_error():
    lines = (DATA / MPI_HELP).read_text().splitlines()
    cut = lines[: lines.index("2 more processes have sent help message help-mpi-btl-base.txt"
                              " / btl:no-nics")]  # fmt: skip
    banner = "-" * 74
    cut += [banner, "mpirun noticed that process rank 2 on node gpu-n01 exited on signal 9 (Killed).",
            banner]  # fmt: skip
    run = parse_nccl_tests("\n".join(cut))
    assert run.complete is False and len(run.rows) == 7
    assert [e["text"][:16] for e in run.errors] == ["mpirun noticed t"]
