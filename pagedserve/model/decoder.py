"""One decoder for the Llama family: Llama (and Mistral, Phi-3), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), and
their mixtures of experts, Mixtral and Qwen3-MoE (a ``SparseMoE`` in place of the MLP).

They differ only in fields of ``ModelConfig``. q/k/v are one merged projection and gate/up another; the loader
maps Hugging Face's separate tensors into them (``PACKED_WEIGHTS``; Phi-3's checkpoints have them merged already),
and each layer's experts into two stacked tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.memory import kv_heads_per_rank
from pagedserve.model.attention import AttentionBackend, AttentionMetadata
from pagedserve.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, SparseMoE, norm_project
from pagedserve.model.parallel import all_gather_last_dim, all_reduce, tp

# Hugging Face tensor name fragment -> (our parameter fragment, shard index in the merged tensor)
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """This rank's heads: q/k/v rows are split over tensor-parallel ranks, o_proj's columns too."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        size = tp().size
        self.num_heads = config.num_heads // size
        self.num_kv_heads = kv_heads_per_rank(config, size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def split_qkv(self, qkv: torch.Tensor, positions: torch.Tensor):
        """The reference path from the fused projection to rotated q, k and v (fused kernels match it)."""
        q, k, v = qkv.split(self.shard_sizes(), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(self, positions, qkv, kv_cache, meta: AttentionMetadata):
        """From the q/k/v projection (the layer runs it, with the norm before it) to o_proj's output."""
        out, early = self.backend.forward(qkv, positions, self, kv_cache, meta)
        # after a kernel that releases it early, o_proj copies its weights in while the attention runs
        return all_reduce(self.o_proj(out.reshape(-1, self.q_size), staged=early))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, index: int):
        super().__init__()
        self.self_attn = Attention(config, rotary, backend)
        if index in config.sparse_layers:
            width = config.expert_intermediate_size // tp().size
            self.mlp = SparseMoE(config.hidden_size, width, config.num_experts, config.experts_per_token,
                                 config.renormalize_experts)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size // tp().size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        """Each norm goes with the projection after it (one kernel for a step of one or two rows on the GEMV)."""
        qkv, residual = norm_project(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
        x = self.self_attn(positions, qkv, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm, x, residual)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary; ids owned by other ranks contribute zeros to the all-reduce."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        g = tp()
        self.per_rank = vocab // g.size
        self.start = g.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, backend, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, backend, max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size // tp().size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Hidden states of every scheduled token: [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (each rank computes its slice; they are gathered)."""
        return all_gather_last_dim(self.lm_head(hidden))

    def shard_sizes(self, packed: str) -> list[int]:
        """Row sizes of the shards of a merged parameter (q/k/v, gate/up, or an expert's gate/up)."""
        if packed == "qkv_proj":
            return self.model.layers[0].self_attn.shard_sizes()
        if packed == "w13":
            return [self.config.expert_intermediate_size // tp().size] * 2
        return [self.config.intermediate_size // tp().size] * 2
