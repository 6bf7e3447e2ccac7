"""Fused RMSNorm(+residual) and SiLU-mul kernels against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagedserve.model import fused  # noqa: E402
from pagedserve.model.layers import RMSNorm  # noqa: E402


@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm_with_and_without_residual(n):
    torch.manual_seed(n)
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(5, n), torch.randn(5, n)
    want_out, want_res = norm(x, r)  # CPU tensors take the torch reference path
    got_out, got_res = fused.rms_norm(x, norm.weight, 1e-6, r)
    assert torch.allclose(got_res, want_res) and torch.allclose(got_out, want_out, atol=1e-5)
    assert torch.allclose(fused.rms_norm(x, norm.weight, 1e-6), norm(x), atol=1e-5)


def test_silu_mul():
    x = torch.randn(3, 2 * 1500)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(fused.silu_mul(x), F.silu(gate) * up, atol=1e-6)
