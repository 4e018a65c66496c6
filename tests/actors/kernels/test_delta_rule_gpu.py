"""On a CUDA GPU: the Triton delta-rule kernels (recurrent, chunk scan) against the float32 CPU
reference (actors/kernels/delta_rule.py), float32 inputs (IEEE products: near float32) and
bfloat16 inputs (bf16 tolerance). Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from actors.kernels import delta_rule as dr
from tests.actors.kernels.test_delta_rule import call, inputs, rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("kind", ["deltanet", "kda"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [1, 3, 200])
def test_the_triton_delta_rule_on_cuda_equals_the_cpu_reference(kind, dtype, tol, t):
    args = inputs(kind, t=t)
    want = call(dr.recurrent_reference if t < 8 else dr.chunk_delta_rule, *args)
    cuda = [x.cuda().to(dtype) if i in (0, 1, 2) else x.cuda() for i, x in enumerate(args)]
    fn = dr.recurrent_delta_rule if t < 8 else dr.chunk_delta_rule
    assert dr.use_triton(cuda[0])
    got = call(fn, *cuda)
    ref = (
        [want[0], want[1]]
        if dtype == torch.float32
        else list(
            call(fn, *[x.to(dtype).float() if i in (0, 1, 2) else x for i, x in enumerate(args)])
        )
    )
    assert rel(got[0].float().cpu(), ref[0]) < tol and rel(got[1].cpu(), ref[1]) < tol
