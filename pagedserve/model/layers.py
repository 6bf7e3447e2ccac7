"""The small building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.model import fused
from pagedserve.model.cuda_gemv import CudaGemv, linear
from pagedserve.model.parallel import all_reduce


class Linear(nn.Linear):
    """A projection whose products of up to 16 rows on the GPU may run as the CUDA GEMV or its tensor-core kernel
    for 3-16 rows (``use_gemv``)."""

    gemv: CudaGemv | None = None

    def forward(self, x: torch.Tensor, staged: bool = False) -> torch.Tensor:
        """``staged``: x comes from a kernel launched to release this one early (see CudaGemv.STAGE)."""
        return linear(x, self.weight, self.bias, self.gemv, staged)


def norm_project(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, proj: Linear):
    """``proj(norm(x + residual))`` and the new residual (x itself where there is none yet); one kernel
    when the projection's GEMV takes the row, else the norm kernel then the projection."""
    gemv = proj.gemv
    if gemv is not None and proj.bias is None and gemv.takes_norm(x, residual, norm.weight, proj.weight):
        return gemv.norm_project(x, residual, norm.weight, norm.eps, proj.weight)
    if residual is None:
        return proj(norm(x)), x
    x, residual = norm(x, residual)
    return proj(x), residual


def use_gemv(model: nn.Module, gemv: CudaGemv | None) -> None:
    """Route the model's projections of up to 16 rows through ``gemv`` (None: cuBLAS for all)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.gemv = gemv


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (or ``x + residual``); with a residual, also return the new residual."""
        if x.is_cuda:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies with the configured scaling (linear, Llama-3's or YaRN's) applied, and the factor that
    cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    d = config.head_dim
    pos_freqs = config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    inv_freq = 1.0 / pos_freqs
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor, 1.0
    old_len = float(scaling["original_max_position_embeddings"])
    if scaling["rope_type"] == "yarn":
        return _yarn(pos_freqs, factor, old_len, config.rope_theta, scaling)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0


def _yarn(pos_freqs: torch.Tensor, factor: float, old_len: float, base: float,
          scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn more than beta_fast times over the trained length keep their frequency, those
    that turn fewer than beta_slow times are divided by ``factor``, a linear ramp between; the attention logits
    grow by 0.1 ln(factor) + 1 (or the configured attention_factor), through cos and sin."""
    dim = 2 * pos_freqs.numel()

    def dim_turning(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dimension's own frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept

    def mscale(k: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale()
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table computed once for every position."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        inv_freq, scale = rope_inv_freq(config)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D]; rotates the two halves of the head dimension."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections merged into one matrix (one GEMM instead of two), and the norm
    before it: a step's rows take the fewest kernels their projections allow."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """down_proj(silu(gate) * up) of norm(x + residual), and the new residual. On the GPU, 3-16 rows form
        silu(gate) * up in gate_up_proj's kernel; one or two rows fold the norm into gate_up_proj and silu(gate) *
        up into down_proj; other steps run the silu-mul kernel between the two. With tensor parallelism each rank
        holds a slice of the width; the partial sums are reduced."""
        gate_up, down, gemv = self.gate_up_proj, self.down_proj, self.gate_up_proj.gemv
        if gemv is not None and gemv.takes_gated(x, gate_up.weight):
            x, residual = norm(x, residual)
            return all_reduce(down(gemv.gated(x, gate_up.weight))), residual
        h, residual = norm_project(norm, x, residual, gate_up)
        if h.is_cuda:
            if down.gemv is not None and down.gemv.takes(h, down.weight, silu_mul=True):  # silu-mul fused in
                return all_reduce(down.gemv(h, down.weight, silu_mul=True)), residual
            return all_reduce(down(fused.silu_mul(h))), residual
        gate, up = h.chunk(2, dim=-1)
        return all_reduce(down(F.silu(gate) * up)), residual


# torch's grouped GEMM: public in newer releases, private from 2.8 (the engine refuses experts without it)
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class SparseMoE(nn.Module):
    """A mixture of SwiGLU experts (Mixtral, Qwen3-MoE): a router scores the experts for each token, the top k run
    and their outputs are summed by the router's softmax weights (renormalised over the k where the model says).

    The token rows are sorted by expert and each expert's rows go through its weights in one grouped GEMM (gate|up,
    then down): every shape is a step's token count times k whatever the routing, so a step of a size replays as
    one CUDA graph. With tensor parallelism each rank holds a slice of every expert's width (as of a dense MLP) and
    the partial sums are reduced."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [gate; up] of each expert
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))       # down
        self.register_buffer("after", torch.arange(1, num_experts + 1), persistent=False)  # each expert's id + 1

    def forward(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weighted sum for norm(x + residual), and the new residual."""
        x, residual = norm(x, residual)
        weights, chosen = self.gate(x).float().softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts = chosen.flatten()
        order = experts.argsort(stable=True)
        token = order // self.top_k  # the token of each row, rows grouped by expert
        # where each expert's rows end (sorted counts, no host sync: a bincount would size its output on the host)
        ends = torch.searchsorted(experts[order], self.after).to(torch.int32)
        h = _grouped_mm(x[token], self.w13.transpose(1, 2), offs=ends)
        gate, up = h.chunk(2, dim=-1)
        out = _grouped_mm((F.silu(gate) * up).contiguous(), self.w2.transpose(1, 2), offs=ends)
        out = out * weights.flatten()[order].unsqueeze(1).to(out.dtype)
        return all_reduce(torch.zeros_like(x).index_add_(0, token, out)), residual
