"""Shared fixtures: small random Hugging Face checkpoints of each supported architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton kernels run under Triton's interpreter when there is no GPU (read when kernels are defined).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:  # fp32 test shapes on a GPU: exact fp32 dots in the kernels, not TF32, like the torch reference
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
except ImportError:
    pass
os.environ.setdefault("PAGEDSERVE_CACHE", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "pagedserve"))

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, rms_norm_eps=1e-6,
               bos_token_id=0, eos_token_id=2, torch_dtype="float32")

ARCH_CONFIGS = {
    "llama": dict(_COMMON, model_type="llama", rope_theta=10000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(_COMMON, model_type="mistral", rope_theta=1e6, sliding_window=None),
    "qwen2": dict(_COMMON, model_type="qwen2", rope_theta=1e6, use_sliding_window=False),
    "qwen3": dict(_COMMON, model_type="qwen3", head_dim=32, rope_theta=1e6, tie_word_embeddings=True,
                  attention_bias=False),
    # q/k/v and gate/up merged in the checkpoint itself
    "phi3": dict(_COMMON, model_type="phi3", rope_theta=1e4, sliding_window=None, pad_token_id=0),
    # mixtures of experts: Qwen3-MoE with a dense layer among the sparse ones, renormalised top-2 of 8
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", head_dim=32, rope_theta=1e6, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(_COMMON, model_type="mixtral", rope_theta=1e6, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint folder per architecture (written by transformers' save_pretrained)."""
    from pagedserve.builtin.tiny import write_random_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_random_checkpoint(root / name, cfg, seed=i) for i, (name, cfg) in enumerate(ARCH_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from pagedserve.builtin.tiny import ensure_tiny_model

    return ensure_tiny_model()
