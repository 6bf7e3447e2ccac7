"""Fused RMSNorm(+residual) and SiLU-mul kernels against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagedserve.model import fused  # noqa: E402
from pagedserve.model.layers import RMSNorm  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter runs on CPU tensors


@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm_with_and_without_residual(n):
    torch.manual_seed(n)
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(5, n), torch.randn(5, n)
    want_out, want_res = norm(x, r)  # CPU tensors take the torch reference path
    w = norm.weight.to(DEV)
    got_out, got_res = fused.rms_norm(x.to(DEV), w, 1e-6, r.to(DEV))
    assert torch.allclose(got_res.cpu(), want_res) and torch.allclose(got_out.cpu(), want_out, atol=1e-5)
    assert torch.allclose(fused.rms_norm(x.to(DEV), w, 1e-6).cpu(), norm(x), atol=1e-5)


def test_silu_mul():
    x = torch.randn(3, 2 * 1500)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(fused.silu_mul(x.to(DEV)).cpu(), F.silu(gate) * up, atol=1e-6)


def _softmax_frequencies(sampler, logits, inv_t, n):
    """Token frequencies over ``n`` rows of the same logits with distinct noise keys."""
    x = logits.repeat(n, 1)
    tokens = sampler(x, torch.full((n,), inv_t), torch.arange(n) * 7919 + 1, torch.ones(n, dtype=torch.bool))
    return torch.bincount(tokens.cpu(), minlength=logits.shape[1]).float() / n


@pytest.mark.parametrize("which", ["triton", "torch"])
def test_gumbel_argmax_samples_the_softmax(which):
    from pagedserve.model.sampler import gumbel_argmax_reference

    def on_device(x, t, seeds, noisy):
        return fused.gumbel_argmax(x.to(DEV), t.to(DEV), seeds.to(DEV), noisy.to(DEV))

    sampler = on_device if which == "triton" else (
        lambda x, t, seeds, noisy: gumbel_argmax_reference(x, t, seeds.tolist(), noisy))
    logits = torch.tensor([[1.0, 2.0, 0.5, float("-inf"), 2.5, -1.0]])
    freq = _softmax_frequencies(sampler, logits, 1 / 0.7, 800)  # deterministic keys: no flakiness
    want = torch.softmax(logits / 0.7, dim=-1)[0]
    assert freq[3] == 0  # a dropped (-inf) token is never drawn
    assert (freq - want).abs().max() < 0.05, (freq, want)  # ~3 standard errors at 800 draws

    # candidates in every quarter of a 1024-column tile: on the GPU, columns c and c + 256 take two
    # outputs of one Philox call, which must be independent (equal logits: ~50 % each)
    spread = torch.full((1, 1024), float("-inf"))
    cols = torch.tensor([5, 261, 517, 773, 1000])
    spread[0, cols] = torch.tensor([1.0, 1.0, 0.0, 2.0, 1.5])
    freq = _softmax_frequencies(sampler, spread, 1.0, 800)
    want = torch.softmax(spread, dim=-1)[0]
    assert abs(float(freq[cols].sum()) - 1) < 1e-6  # never a -inf column
    assert (freq[cols] - want[cols]).abs().max() < 0.05, (freq[cols], want[cols])


def test_gumbel_argmax_greedy_rows_and_noise_keys():
    torch.manual_seed(0)
    v = 3000  # several blocks, so the vocabulary is split over programs
    x = torch.randn(4, v, device=DEV)
    x[1, 17] = x[1, 2500] = 50.0  # a tie: the first index wins, as with torch.argmax
    x[3] = x[0]
    seeds = torch.tensor([5, 6, 7, 5], device=DEV)
    noisy = torch.tensor([True, False, True, True], device=DEV)
    ones = torch.ones(4, device=DEV)
    got = fused.gumbel_argmax(x, ones, seeds, noisy)
    assert got[1] == 17
    assert got[0] == got[3]  # same key, same logits: same token, whatever the row
    # the noise is a function of (key, column): the split of the vocabulary does not change the draw
    assert torch.equal(fused.gumbel_argmax(x, ones, seeds, noisy, num_sms=1), got)
    alone = fused.gumbel_argmax(x[2:3], ones[:1], seeds[2:3], noisy[2:3])
    assert alone[0] == got[2]
