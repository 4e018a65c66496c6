"""`moectl bench long-context`: a tiny sweep's JSON and PNG, inflection detection, bad input."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import typer

from actors.bench.long_context_cli import parse_lengths, register
from actors.bench.long_context_sweep import find_inflections
from cluster.errors import InputError


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        pass

    register(app)
    return app


def _png_pixels(data: bytes) -> tuple[int, int, set]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        assert (
            zlib.crc32(kind + body)
            == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        )
        if kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    colours = {
        raw[y * stride + 1 + 3 * x : y * stride + 4 + 3 * x]
        for y in range(0, height, 3)
        for x in range(0, width, 3)
    }
    return width, height, colours


def test_tiny_sweep_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "lc.json", tmp_path / "lc.png"
    _app()(
        [
            "bench",
            "long-context",
            "--lengths",
            "1K,4K",
            "--mode",
            "sparse",
            "--chunk",
            "512",
            "--window",
            "8",
            "--top-k",
            "8",
            "--decode-tokens",
            "2",
            "--device-budget",
            "256K",
            "--work-dir",
            str(tmp_path / "w"),
            "--out",
            str(out),
            "--plot",
            str(png),
            "--json",
        ],
        standalone_mode=False,
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads(out.read_text())
    assert printed["rows"] == report["rows"]
    assert report["mode"] == "sparse" and isinstance(report["inflections"], list)
    assert [r["length"] for r in report["rows"]] == [1024, 4096]
    for row in report["rows"]:
        assert row["ok"] is True
        assert row["prefill_s"] > 0 and row["ttft_s"] >= row["prefill_s"]
        assert row["decode_ms_per_token"] > 0
        assert {"device", "host", "disk"} <= set(row["peak_bytes"])
    # 4K tokens of 2 layers x 2 KV heads x 32 dims x (k, v) x float32 = 4 MiB: most went down.
    big = report["rows"][1]
    assert big["offloaded_blocks"] > 0 and big["peak_bytes"]["host"] > 0
    assert big["peak_device_kv_bytes"] <= 256 * 1024 + 512 * 2 * 2 * 2 * 32 * 4
    width, height, colours = _png_pixels(png.read_bytes())
    assert (width, height) == (1040, 420)
    assert len(colours) >= 4  # background, grid, axes, series


def test_inflections_follow_the_expected_slopes():
    rows = [
        {"length": 1000, "ok": True, "prefill_s": 1.0, "decode_ms_per_token": 2.0},
        {"length": 10000, "ok": True, "prefill_s": 10.0, "decode_ms_per_token": 2.2},
        {"length": 100000, "ok": True, "prefill_s": 100.0, "decode_ms_per_token": 50.0},
        {"length": 1000000, "ok": False, "error": "MemoryError: out"},
    ]
    found = find_inflections(rows, "sparse")
    # Decode is flat to 10K (slope 0.04), then grows with slope log10(50/2.2) = 1.36 > 0.5.
    assert [(f["metric"], f["from_length"]) for f in found] == [
        ("decode_ms_per_token", 10000),
        ("failure", 1000000),
    ]
    assert found[0]["slope"] == pytest.approx(1.36, abs=0.01)
    # Exact attention: prefill per token and decode should grow like L (slope 1).
    exact = find_inflections(rows[:2], "exact")
    assert {f["metric"] for f in exact} == {"decode_ms_per_token", "prefill_s_per_token"}


def test_lengths_parse_binary_units_and_refuse_garbage():
    assert parse_lengths("1K,8K,1M") == (1024, 8192, 1 << 20)
    with pytest.raises(InputError, match="'8Q'") as info:
        _app()(["bench", "long-context", "--lengths", "1K,8Q"], standalone_mode=False)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_bfloat16_model_halves_the_kv_block_and_bad_dtype_is_refused():
    import torch

    from actors.bench.long_context_sweep import block_bytes, build_model

    stage = build_model("tiny", seed=0, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    # 16 tokens x (k, v) x 2 KV heads x 32 dims x 2 bytes.
    assert block_bytes(stage.arch, 16, torch.bfloat16) == 16 * 2 * 2 * 32 * 2
    with pytest.raises(InputError, match="'float16'"):
        build_model("tiny", seed=0, device="cpu", dtype="float16")
