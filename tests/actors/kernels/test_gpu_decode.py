"""On a CUDA GPU: the device path (bf16, grouped GEMMs, CUDA graphs, Triton decode attention)
against the CPU float32 path on tiny models of both families, step by step. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_device_decode_path_matches_cpu_float32():
    from actors.bench.gpu_checks import correctness, triton_check

    device = torch.device("cuda")
    ok, _ = triton_check(device)
    result = correctness(device, torch.bfloat16, flags={"triton": ok, "graphs": True})
    for name, check in result.items():
        assert check["ok"], (name, check)


def test_triton_decode_kernel_matches_torch_on_device():
    from actors.bench.gpu_checks import triton_check
    from actors.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    ok, note = triton_check(torch.device("cuda"))
    assert ok, note


def test_triton_mla_decode_matches_torch_on_device():
    from actors.bench.gpu_checks import mla_check
    from actors.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    result = mla_check(torch.device("cuda"))
    assert result["ok"], result
