"""config.json facts of a few well-known open-weight models.

They let names such as ``Qwen/Qwen3-8B`` run with ``load_format="dummy"`` (and let the planner size
them) on a machine that cannot download anything. Only the fields the engine reads are kept; the
values are those of the published checkpoints' ``config.json``.
"""

from __future__ import annotations

_QWEN3_COMMON = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_LLAMA3_COMMON = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


_MISTRAL_COMMON = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _llama3_rope(factor: float) -> dict:
    """Llama 3.1 / 3.2's long-context rotary scaling, which differs between them only by its factor."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


KNOWN_MODELS: dict[str, dict] = {
    "Qwen/Qwen3-0.6B": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-1.7B": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-4B": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-8B": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-14B": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-32B": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-30B-A3B": {
        **_QWEN3_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "meta-llama/Llama-3.2-1B": {
        **_LLAMA3_COMMON,
        "rope_scaling": _llama3_rope(32.0),
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "meta-llama/Llama-3.2-3B": {
        **_LLAMA3_COMMON,
        "rope_scaling": _llama3_rope(32.0),
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "meta-llama/Llama-3.1-8B": {
        **_LLAMA3_COMMON,
        "rope_scaling": _llama3_rope(8.0),
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "meta-llama/Llama-3.1-70B": {
        **_LLAMA3_COMMON,
        "rope_scaling": _llama3_rope(8.0),
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "mistralai/Mistral-7B-v0.3": {
        **_MISTRAL_COMMON,
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32768,
    },
    "mistralai/Mixtral-8x7B-v0.1": {  # each of its 8 experts has Mistral 7B's MLP
        **_MISTRAL_COMMON,
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
    },
}
