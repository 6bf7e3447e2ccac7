"""The built-in tiny model, and the writer of random Hugging Face checkpoints it shares with the tests.

Nothing can be downloaded, so the default model is made locally on first use: random weights in a real
Hugging Face checkpoint folder (config.json + model.safetensors) and a small byte-level BPE tokenizer
trained with ``tokenizers`` on a built-in text, with a ChatML chat template. The same loader that reads
real checkpoints reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_MODEL_NAMES = ("tiny", "pagedserve/tiny")
_TINY_VERSION = "1"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 2,
}

_CORPUS = """\
Continuous batching keeps the accelerator busy by admitting new requests whenever others finish.
A paged key-value cache stores attention keys and values in fixed-size blocks, like pages of memory.
The scheduler limits each step by the number of sequences and by the number of batched tokens.
Chunked prefill splits a long prompt into pieces so that short requests keep their place in the step.
When the cache runs out of blocks, the newest running request is preempted and recomputed later.
Time to first token measures queueing and prefill; inter-token latency measures the decode loop.
Raise concurrency step by step: one, two, four, eight, sixteen, thirty-two, and watch the knee.
The production setting belongs to the left of the knee, where latency is still flat.
Keep a normal profile and a protect profile, and a runbook that says when to switch between them.
Hello world! The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
What is the capital of France? Paris is the capital of France. Tell me a story about a small robot.
def main(): print("hello")  # code, punctuation, and symbols: {} [] () <> = + - * / % & | ^ ~ ! ? : ;
"""


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def train_tokenizer(vocab_size: int, corpus: str = _CORPUS):
    """A byte-level BPE tokenizer (any text encodes), wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.splitlines() * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def write_random_checkpoint(path: Path, hf_config: dict, *, seed: int = 0, std: float = 0.1,
                            max_shard_size: str | None = None, with_tokenizer: bool = True) -> Path:
    """Write a Hugging Face checkpoint folder with random weights of ``hf_config``'s architecture.

    The weights are drawn with a larger std than transformers' init so that greedy decoding is
    decisive (comparisons with a reference then test the math, not rounding between near-ties).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # float32: torch's default dtype
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if with_tokenizer:
        tokenizer = train_tokenizer(hf_config["vocab_size"])
        tokenizer.save_pretrained(path)
    return path


def ensure_tiny_model() -> Path:
    """Return the tiny model's folder, creating it once (atomically, so concurrent first uses agree)."""
    target = cache_dir() / "models" / f"tiny-v{_TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
    try:
        write_random_checkpoint(tmp, TINY_CONFIG, seed=0)
        json.loads((tmp / "config.json").read_text())  # written whole before the rename below
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
