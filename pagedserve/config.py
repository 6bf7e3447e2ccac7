"""Configuration: the model's facts and the engine's arguments, validated in one place.

``EngineArgs`` holds what a user sets (vLLM's names; the CLI flags are generated from its fields).
``EngineArgs.create_config()`` resolves defaults against the model and the device and raises
``ConfigError`` naming the flag to change. Everything downstream reads the resolved ``EngineConfig``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.checks import wrong_type
from pagedserve.errors import ConfigError, InvalidRequestError, option
from pagedserve.reasoning import REASONING_PARSERS
from pagedserve.sampling_params import SamplingParams


def flag(name: str) -> str:
    """``max_num_seqs`` -> ``max_num_seqs (--max-num-seqs)``: errors serve both API and CLI users."""
    return f"{name} ({option(name)})"


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: str | int | float | None, what: str) -> int | None:
    """Parse ``8192``, ``8k``, ``1K``, ``4GiB``, ``512MB`` into an int (tokens or bytes)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", str(value))
    if not m:
        raise ConfigError(f"{flag(what)}: cannot parse {value!r}; use an integer such as 8192, 8k or 4GiB.")
    unit = (m.group(2) or "").lower()
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


# --------------------------------------------------------------------------------------------------
# Model facts
# --------------------------------------------------------------------------------------------------

_SUPPORTED_TYPES = {"llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe"}
_WINDOW_UNLESS_SAID = ("mistral", "mixtral", "phi3")  # their sliding_window applies without use_sliding_window
_REQUIRED_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# rotary scalings, with the numbers each needs besides its factor, and those it may give
_ROPE_NEEDS = {"linear": (), "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "yarn": ("original_max_position_embeddings",)}
_ROPE_MAY = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face ``config.json``."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # the keys a query sees, where the model limits them
    # a mixture of experts (Mixtral, Qwen3-MoE): its experts, those each token takes, each expert's MLP width,
    # whether the chosen experts' weights are renormalised to sum to 1, and the layers that have them
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    renormalize_experts: bool = False
    sparse_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json holds a {type(cfg).__name__}, not an object of the model's facts.")
        model_type = cfg.get("model_type", "")
        if model_type not in _SUPPORTED_TYPES:
            raise ConfigError(
                f"Unsupported architecture model_type={model_type!r} "
                f"(supported: {', '.join(sorted(_SUPPORTED_TYPES))}).")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type in _WINDOW_UNLESS_SAID) else None
        if window is not None and not _positive_int(window):
            raise ConfigError(f"config.json: sliding_window is {window!r}; give a positive integer, or null for none.")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"Unsupported hidden_act={cfg.get('hidden_act')!r}: only silu is supported.")
        rope_theta, rope_scaling = _rope(cfg)
        max_positions = cfg.get("max_position_embeddings", 4096)
        for key, value in [*((k, cfg.get(k)) for k in _REQUIRED_SIZES), ("max_position_embeddings", max_positions)]:
            if not _positive_int(value):
                raise ConfigError(f"config.json: {key} is {value!r}; a {model_type} checkpoint gives it as a positive "
                                  f"integer (needed: {', '.join(_REQUIRED_SIZES)}).")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            **_experts(cfg, model_type),
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Mistral only when attention_bias says so.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            sliding_window=window,
        )

    def context_limit(self) -> tuple[int, str]:
        """The longest context this engine runs the model at, and why: the positions' reach (max_position_embeddings,
        which a linear scaling stretches by its factor and YaRN replaces with the length it was trained at times
        its factor, vLLM's rule; Llama-3's scaling is already counted in the file's value), or a sliding window,
        since the engine attends over whole contexts, which is the same attention up to the window's length."""
        scaling = self.rope_scaling or {}
        kind, factor = scaling.get("rope_type"), scaling.get("factor", 1)
        if kind == "yarn":
            limit, why = int(scaling["original_max_position_embeddings"] * factor), \
                "YaRN's original_max_position_embeddings times its factor"
        elif kind == "linear":
            limit, why = int(self.max_position_embeddings * factor), "max_position_embeddings times the linear factor"
        else:
            limit, why = self.max_position_embeddings, ("max_position_embeddings in config.json; where the model's "
                                                        "authors recommend it, a rope scaling in --hf-overrides (e.g. "
                                                        "YaRN) stretches it")
        if self.sliding_window is not None and self.sliding_window < limit:
            return self.sliding_window, ("sliding_window in config.json: pagedserve attends over whole contexts, the "
                                         "same attention as the model's up to the window's length")
        return limit, why

    def num_params(self) -> int:
        """Parameter count; tied embeddings are counted once."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * d
        experts = self.num_experts * (3 * h * self.expert_intermediate_size + h)  # and the router's row each
        sparse = len(self.sparse_layers)
        layers = self.num_layers * (attn + 2 * h) + (self.num_layers - sparse) * 3 * h * i + sparse * experts
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return layers + embed + head + h

    def active_params(self) -> int:
        """The parameters one token computes with: a mixture of experts' untaken experts left out."""
        idle = self.num_experts - self.experts_per_token
        return self.num_params() - len(self.sparse_layers) * idle * 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def mlp_rows_width(self) -> int:
        """The widest MLP activation a token makes: a dense layer's, or its experts' side by side."""
        sparse = self.experts_per_token * self.expert_intermediate_size if self.sparse_layers else 0
        dense = self.intermediate_size if len(self.sparse_layers) < self.num_layers else 0
        return max(sparse, dense)


def _experts(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A mixture of experts' facts as ``ModelConfig`` takes them (none for a dense model): Mixtral's in every
    layer, renormalised; Qwen3-MoE's in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    mixtral = model_type == "mixtral"
    facts = {"num_experts": cfg.get("num_experts", cfg.get("num_local_experts")),  # transformers 5 writes the latter
             "experts_per_token": cfg.get("num_experts_per_tok"),
             "expert_intermediate_size": cfg.get("intermediate_size" if mixtral else "moe_intermediate_size"),
             "decoder_sparse_step": 1 if mixtral else cfg.get("decoder_sparse_step", 1)}
    for key, value in facts.items():
        if not _positive_int(value):
            raise ConfigError(f"config.json: a {model_type} checkpoint gives its {key} as a positive integer, not "
                              f"{value!r}.")
    if facts["experts_per_token"] > facts["num_experts"]:
        raise ConfigError(f"config.json: num_experts_per_tok {facts['experts_per_token']} is more than the "
                          f"{facts['num_experts']} experts.")
    dense = set(cfg.get("mlp_only_layers") or [])
    step = facts.pop("decoder_sparse_step")
    layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return {**facts, "renormalize_experts": mixtral or bool(cfg.get("norm_topk_prob", False)), "sparse_layers": layers}


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """config.json's rotary base and scaling (None: unscaled), every number the scaling uses checked here.
    transformers >= 5 writes both into "rope_parameters"; a "rope_scaling" beside it (an older file, or one
    given in --hf-overrides) is read over it."""
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    if cfg.get("rope_theta", rope_theta) != rope_theta:
        raise ConfigError(f"config.json (with --hf-overrides over it): rope_theta is {cfg['rope_theta']!r} at the top "
                          f"and {rope_theta!r} in rope_parameters, where transformers >= 5 keeps it; give it in one "
                          f"place, e.g. --hf-overrides '{{\"rope_parameters\": {{\"rope_theta\": ...}}}}'.")
    if not _positive_number(rope_theta):
        raise ConfigError(f"config.json: rope_theta is {rope_theta!r}; give a positive number.")
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor is {partial!r}: rotary embeddings over part of a head "
                          f"are not supported (only whole heads, 1.0).")
    kind = rope.pop("type", None) or rope.get("rope_type", "default")
    if kind == "default":
        return float(rope_theta), None
    if kind not in _ROPE_NEEDS:
        raise ConfigError(f"Unsupported rope scaling type {kind!r} (supported: default, {', '.join(_ROPE_NEEDS)}).")
    for key in ("factor", *_ROPE_NEEDS[kind], *_ROPE_MAY.get(kind, ())):
        value = rope.get(key)
        if _positive_number(value) or (key in _ROPE_MAY.get(kind, ()) and (value is None or value == 0)):
            continue  # a 0 or null that it may give means "the default", as in transformers
        raise ConfigError(f"config.json: the {kind} rope scaling's {key} is {value!r}; give a positive "
                          f"number (it needs factor{''.join(', ' + k for k in _ROPE_NEEDS[kind])}).")
    return float(rope_theta), {**rope, "rope_type": kind}


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# The largest step with prompt tokens replayed as a CUDA graph unless told: launched kernel by kernel, such a
# step waits on the host (~0.8 ms a layer in a serving process), at least the GPU's time for a 1,024-token step
# of models up to 8B.
DEFAULT_CAPTURE_SIZE = 4096


# --------------------------------------------------------------------------------------------------
# Where a model comes from
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    """A resolved ``model`` argument: its config and, when it is a folder, where its files are."""

    name: str
    hf_config: dict
    path: Path | None  # None: only config facts are known (dummy weights, no tokenizer)


def read_json(file: Path, field: str, remedy: str = "") -> Any:
    """A checkpoint's JSON file; one that cannot be read or parsed names itself and the flag that chose it (and
    ``remedy``, what to do about it)."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag(field)}: {str(file)!r} could not be read as JSON ({e})."
                          + (f" {remedy}" if remedy else "")) from e


def resolve_model(model: str, load_format: str) -> ModelSource:
    from pagedserve.builtin.known_models import KNOWN_MODELS
    from pagedserve.builtin.tiny import TINY_MODEL_NAMES, ensure_tiny_model

    if model in TINY_MODEL_NAMES:
        path = ensure_tiny_model()
        return ModelSource(model, read_json(path / "config.json", "model"), path)
    path = Path(os.path.expanduser(model))
    if (path / "config.json").is_file():
        return ModelSource(model, read_json(path / "config.json", "model"), path)
    if path.exists():
        raise ConfigError(f"{flag('model')}: folder {str(path)!r} has no config.json.")
    if model in KNOWN_MODELS:
        if load_format != "dummy":
            raise ConfigError(
                f"{flag('model')}: {model!r} is not a local checkpoint folder and weights cannot be "
                f"downloaded here. Pass a folder with config.json and *.safetensors, or add "
                f"--load-format dummy to run its architecture with random weights.")
        return ModelSource(model, dict(KNOWN_MODELS[model]), None)
    raise ConfigError(
        f"{flag('model')}: {model!r} is neither a local folder with config.json nor a built-in model "
        f"(built-in: tiny, {', '.join(KNOWN_MODELS)}).")


# the keys of a generation_config.json that set default sampling parameters (the ones vLLM reads)
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What the model's authors recommend in ``generation_config.json``, with the operator's overrides:
    default sampling parameters for requests that leave them unset, a default output length, and more
    end-of-sequence tokens."""

    sampling: dict[str, float]
    max_tokens: int | None   # max_new_tokens: the output length of a request that sets none
    eos_token_ids: tuple[int, ...]
    source: str | None = None  # where the defaults came from, for the log

    @classmethod
    def read(cls, choice: str, source: ModelSource, override: str | dict | None = None) -> GenerationDefaults:
        """``choice`` is --generation-config: auto (the model folder's file, if it has one), vllm (none), or
        a folder with a generation_config.json; ``override`` (--override-generation-config, JSON or a
        mapping) sets values over the file's."""
        cfg, where = {}, []
        if not (choice == "vllm" or (choice == "auto" and source.path is None)):
            folder = source.path if choice == "auto" else Path(os.path.expanduser(choice))
            file = folder / "generation_config.json"
            if file.is_file():
                cfg = read_json(file, "generation_config", "Fix it, or pass --generation-config vllm to ignore it.")
                where.append(str(file))
            elif choice != "auto":
                raise ConfigError(f"{flag('generation_config')}: {str(folder)!r} has no generation_config.json (or "
                                  f"pass auto for the model folder's, vllm for none).")
        fix = "Fix the file, or pass --generation-config vllm to ignore it."
        if override is not None:
            extra = _override_mapping(override)
            cls._checked(extra, f"{flag('override_generation_config')}:", "Fix the value, or leave the flag out.")
            cfg, fix = {**cfg, **extra}, "Fix the file, or override the value with --override-generation-config."
            where.append("--override-generation-config")
        defaults = cls._checked(cfg, f"{flag('generation_config')}: {where[0] if where else ''!r}:", fix)
        return cls(*defaults, " and ".join(where) or None)

    @staticmethod
    def _checked(cfg: dict, where: str, fix: str) -> tuple[dict, int | None, tuple[int, ...]]:
        """(sampling defaults, max_tokens, eos ids) of a generation config, or a ConfigError saying what is wrong."""
        sampling = {k: cfg[k] for k in _GENERATION_DEFAULTS if cfg.get(k) is not None}
        max_tokens, eos = cfg.get("max_new_tokens"), cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        try:
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise InvalidRequestError("max_new_tokens",
                                          f"max_new_tokens must be a positive integer, got {max_tokens!r}.")
            if not all(isinstance(t, int) and t >= 0 for t in eos_ids):
                raise InvalidRequestError("eos_token_id", f"eos_token_id must be token ids, got {eos!r}.")
            if not isinstance(sampling.get("top_k", 0), int):
                raise InvalidRequestError("top_k", f"top_k must be an integer, got {sampling['top_k']!r}.")
            SamplingParams(**sampling)
        except (InvalidRequestError, TypeError) as e:
            raise ConfigError(f"{where} {e} {fix}") from e
        return sampling, max_tokens, eos_ids

    def describe(self) -> str:
        values = {**self.sampling, **({"max_tokens": self.max_tokens} if self.max_tokens else {})}
        return ", ".join(f"{k}={v}" for k, v in values.items())


def json_object(value: str | dict, name: str, example: str) -> dict:
    """A flag's JSON object (``name``: the flag as an error names it): text on the command line, a mapping as it is
    from Python or YAML."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{name}: {value!r} is not JSON ({e}); give an object such as '{example}'.") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: {value!r} is not a JSON object; give one such as '{example}'.")
    return value


def _overridden(hf_config: dict, overrides: str | dict | None) -> dict:
    """config.json with --hf-overrides over it: a key's value replaces the file's, an object updates the file's
    object (so a rope scaling keeps the file's rope_theta beside it)."""
    if overrides is None:
        return hf_config
    merged = dict(hf_config)
    for key, value in json_object(overrides, flag("hf_overrides"), '{"max_position_embeddings": 65536}').items():
        old = merged.get(key)
        merged[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    return merged


def _override_mapping(value: str | dict) -> dict:
    """--override-generation-config's value, of the keys a generation config sets."""
    value = json_object(value, flag("override_generation_config"), '{"temperature": 0.6}')
    allowed = (*_GENERATION_DEFAULTS, "max_new_tokens")
    if set(value) - set(allowed):
        raise ConfigError(f"{flag('override_generation_config')}: {value!r}: give an object of "
                          f"{', '.join(allowed)}.")
    return value


# --------------------------------------------------------------------------------------------------
# Engine arguments
# --------------------------------------------------------------------------------------------------

def check_step_limits(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      chunked_prefill: bool) -> None:
    """The rules a step's two limits obey, at start-up and whenever they change at runtime."""
    seqs, batched = max_num_seqs, max_num_batched_tokens
    if not isinstance(seqs, int) or seqs <= 0:
        raise ConfigError(f"{flag('max_num_seqs')}: {seqs} must be a positive integer.")
    if not isinstance(batched, int) or batched <= 0:
        raise ConfigError(f"{flag('max_num_batched_tokens')}: {batched} must be a positive integer.")
    if batched < seqs:
        raise ConfigError(
            f"{flag('max_num_batched_tokens')} ({batched}) must be at least {flag('max_num_seqs')} "
            f"({seqs}): every running request needs one token of the step's budget to decode. "
            f"Raise --max-num-batched-tokens or lower --max-num-seqs.")
    if not chunked_prefill and batched < max_model_len:
        raise ConfigError(
            f"{flag('max_num_batched_tokens')} ({batched}) is smaller than {flag('max_model_len')} "
            f"({max_model_len}) with chunked prefill off: a long prompt could never be scheduled. "
            f"Raise --max-num-batched-tokens, lower --max-model-len, or pass --enable-chunked-prefill.")


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
_LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Engine arguments with vLLM's names. ``None`` means "derive a default"."""

    model: str = _arg("tiny", "Model: a local Hugging Face folder, 'tiny' (built in), or a built-in name such as Qwen/Qwen3-8B with --load-format dummy.", positional=True)
    tokenizer: str | None = _arg(None, "Tokenizer folder (default: the model folder).")
    skip_tokenizer_init: bool = _arg(False, "Do not load a tokenizer; prompts must be token ids.")
    dtype: str = _arg("auto", "Weight and activation dtype: auto, bfloat16, float16, float32 (auto: float32 on CPU, the checkpoint's dtype on CUDA).")
    load_format: str = _arg("auto", "auto/safetensors: read *.safetensors; dummy: random weights of the architecture.")
    hf_overrides: str | dict | None = _arg(None, "Values over the model's config.json, as JSON (a dict from Python), e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}}' for Qwen3's 131,072-token context, as its authors describe. A key's value replaces the file's; an object is merged into the file's object of that name.")
    seed: int = _arg(0, "Seed for dummy weights and for sampling without a per-request seed.")
    generation_config: str = _arg("auto", "Default sampling parameters for requests that leave them unset: auto (the model folder's generation_config.json, as its authors recommend: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; its eos_token_id also ends a sequence), vllm (neutral defaults; the file is ignored), or a folder with a generation_config.json.")
    override_generation_config: str | dict | None = _arg(None, "Sampling defaults over the generation config's, as JSON (a dict from Python), e.g. '{\"temperature\": 0.6, \"max_new_tokens\": 512}' (keys: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): merged onto the model's file with --generation-config auto, used alone with vllm.")
    max_logprobs: int = _arg(20, "Most logprobs a request may ask for a token (logprobs, top_logprobs, prompt_logprobs); -1: the vocabulary's size. A request over it is refused with this flag's name.")
    reasoning_parser: str | None = _arg(None, "A reasoning model's <think> convention: qwen3 (Qwen3) or deepseek_r1 (DeepSeek-R1, QwQ). The server returns the reasoning apart from the answer (reasoning_content), and a structured-output grammar holds only from the end of the reasoning.")
    max_model_len: int | str | None = _arg(None, "Context length (prompt + output); accepts 8k-style values. Default: the model's (max_position_embeddings, or what its rope scaling stretches it to). auto (or -1): the model's if one request of it fits in the KV cache, else the longest that does, chosen once the memory is profiled.", size=True)
    max_num_seqs: int | None = _arg(None, "Most requests running in one step (default 256 on CUDA, 128 on CPU).")
    max_num_batched_tokens: int | None = _arg(None, "Token budget of one step (default 8192 on CUDA, 2048 on CPU; max_model_len without chunked prefill).", size=True)
    enable_chunked_prefill: bool = _arg(True, "Split long prompts over steps to fit the token budget.")
    max_mixed_prefill_tokens: int | None = _arg(None, "While requests decode, a step takes at most this many prompt tokens (longer prompts go on in later steps), so a newly admitted prompt adds at most that much to the running streams' inter-token latency; on a GPU a few fewer where that makes the step's tokens, decodes included, the size of a CUDA graph (a step just over one is padded to the next). 0: only --max-num-batched-tokens bounds them. Needs chunked prefill. Default: 256 for `serve` (latency first), 0 offline (throughput first).")
    scheduling_policy: str = _arg("fcfs", "Which waiting request starts first: fcfs (arrival order) or priority (a request's priority field, lower first, then arrival; under memory pressure the least urgent running request is preempted).")
    enable_prefix_caching: bool = _arg(True, "Reuse the KV blocks of a shared prompt prefix across requests.")
    block_size: int = _arg(16, "Tokens per KV-cache block.")
    gpu_memory_utilization: float = _arg(0.9, "Fraction of total GPU memory for this engine: weights, activations and KV cache.")
    kv_cache_memory: int | None = _arg(None, "KV-cache bytes (e.g. 4GiB); skips the utilization-based sizing. Default on CPU: 1GiB.", size=True)
    num_gpu_blocks_override: int | None = _arg(None, "Force the number of KV blocks (testing preemption).")
    kv_cache_dtype: str = _arg("auto", "KV-cache storage: auto (model dtype), bfloat16, float16, float32, fp8 (=fp8_e4m3), fp8_e5m2.")
    device: str = _arg("auto", "auto, cuda or cpu.")
    enforce_eager: bool = _arg(False, "Never capture CUDA graphs.")
    max_cudagraph_capture_size: int | None = _arg(None, "Largest step with prompt tokens (prompt chunks, with or without decodes) replayed as a CUDA graph; larger ones are launched kernel by kernel, which holds the step to the host's launch time. Up to --max-num-batched-tokens; each graph over 256 tokens pads its steps by at most an eighth. Decode-only steps have graphs up to --max-num-seqs whatever this is. Default: 4096 (vLLM's is 512): a larger prompt step launched kernel by kernel waits on the host's launch, for models up to 8B at least.", size=True)
    tensor_parallel_size: int = _arg(1, "Number of GPUs to shard the model over.")
    attention_backend: str = _arg("auto", "Attention implementation: auto (triton on CUDA, torch elsewhere), triton, or torch (the reference).")
    trust_remote_code: bool = _arg(False, "Accepted for vLLM compatibility, and refused: pagedserve never runs code from a model folder.")
    quantization: str | None = _arg(None, "Accepted for vLLM compatibility: only none (16/32-bit weights) runs here; --kv-cache-dtype fp8 halves the KV cache.")

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "generation_config"):  # folders, which a Python caller may give as Paths
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def _check_types(self) -> None:
        """Each value of its field's type: the CLI converts its strings, but ``LLM(...)`` takes what a caller
        passes (a size also takes a string such as 8k or 4GiB, parsed later)."""
        wrong = wrong_type(self, lambda name, v: isinstance(v, str) and name in _SIZE_FIELDS)
        if wrong:
            raise ConfigError(f"{flag(wrong[0])}: {getattr(self, wrong[0])!r} is not {wrong[1]}.")

    def create_config(self, plan_for: str | None = None, serving: bool = False) -> "EngineConfig":
        """Resolve every default and validate every value; the one place config errors come from.
        ``plan_for="cuda"`` resolves as the engine would on a GPU that this machine need not have (the
        planner's case; weights are never read then). ``serving``: the engine behind ``pagedserve serve``,
        whose defaults put the running streams' latency first (the offline engine's, throughput)."""
        self._check_types()
        if self.trust_remote_code:
            raise ConfigError(f"{flag('trust_remote_code')}: pagedserve never runs code from a model folder; it serves "
                              f"Llama, Mistral, Mixtral, Phi-3/4, Qwen2, Qwen3 and Qwen3-MoE from config.json and the "
                              f"weights alone. Leave the flag out.")
        if self.quantization not in (None, "none"):
            raise ConfigError(f"{flag('quantization')} {self.quantization}: quantized weights do not run here (only "
                              f"16- and 32-bit weights do). To save memory, --kv-cache-dtype fp8 halves the KV cache.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"{flag('reasoning_parser')} {self.reasoning_parser}: not one of "
                              f"{', '.join(REASONING_PARSERS)} (leave it out for a model that does not reason).")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"{flag('scheduling_policy')} {self.scheduling_policy}: not one of fcfs, priority.")
        if self.load_format not in _LOAD_FORMATS:
            raise ConfigError(f"{flag('load_format')}: {self.load_format!r} is not one of {', '.join(_LOAD_FORMATS)}.")
        source = resolve_model(self.model, "dummy" if plan_for else self.load_format)
        generation = GenerationDefaults.read(self.generation_config, source, self.override_generation_config)
        model_config = ModelConfig.from_hf_dict(_overridden(source.hf_config, self.hf_overrides))

        device = torch.device(plan_for) if plan_for else self._resolve_device()
        dtype = self._resolve_dtype(model_config, device)
        kv_dtype = self._resolve_kv_dtype(dtype)

        size, m = self.tensor_parallel_size, model_config
        if size < 1 or any(n % size for n in (m.num_heads, m.intermediate_size, m.vocab_size)) or (
                m.num_kv_heads % size and size % m.num_kv_heads):
            raise ConfigError(
                f"{flag('tensor_parallel_size')}: {size} must be >= 1 and divide the {m.num_heads} attention heads, "
                f"the MLP width {m.intermediate_size} and the vocabulary {m.vocab_size}, and divide or be a "
                f"multiple of the {m.num_kv_heads} KV heads.")
        if m.sparse_layers and m.expert_intermediate_size % size:
            raise ConfigError(f"{flag('tensor_parallel_size')}: {size} must divide the experts' MLP width "
                              f"{m.expert_intermediate_size} (each rank holds a slice of every expert).")
        if m.sparse_layers and not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
            raise ConfigError(f"A mixture-of-experts model ({m.model_type}) runs its experts as torch's grouped GEMMs, "
                              f"which torch {torch.__version__} lacks; install torch 2.8 or newer.")
        if m.sparse_layers and device.type == "cuda" and dtype != torch.bfloat16:
            raise ConfigError(f"{flag('dtype')}: a mixture-of-experts model runs its experts as grouped GEMMs, which "
                              f"take bfloat16 on a GPU; use --dtype bfloat16.")
        if device.type == "cuda" and not plan_for and size > (gpus := torch.cuda.device_count()):
            # a rank a GPU: a rank without one would fail in its own process while the others wait for it
            raise ConfigError(
                f"{flag('tensor_parallel_size')}: {size} ranks need {size} GPUs, one each, but {gpus} "
                f"{'is' if gpus == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Use at most {gpus}, or make more GPUs visible.")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"{flag('attention_backend')}: {self.attention_backend!r} is not one of auto, torch, triton.")
        if self.attention_backend == "triton" and importlib.util.find_spec("triton") is None:
            raise ConfigError(f"{flag('attention_backend')}: triton is not installed; use --attention-backend torch.")
        if self.block_size not in _BLOCK_SIZES:
            raise ConfigError(f"{flag('block_size')}: {self.block_size} is not one of {_BLOCK_SIZES}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"{flag('gpu_memory_utilization')}: {self.gpu_memory_utilization} must be in (0, 1].")

        fit_to_cache = str(self.max_model_len).strip().lower() in ("auto", "-1")
        max_model_len = None if fit_to_cache else parse_size(self.max_model_len, "max_model_len")
        limit, where = model_config.context_limit()
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len <= 0:
            raise ConfigError(f"{flag('max_model_len')}: {max_model_len} must be positive, or auto (-1) for the "
                              f"longest that fits in the KV cache.")
        elif max_model_len > limit:
            raise ConfigError(
                f"{flag('max_model_len')}: {max_model_len} is larger than the model's maximum context "
                f"length ({limit}: {where}). Use at most {limit}.")

        if fit_to_cache and not self.enable_chunked_prefill:
            raise ConfigError(f"{flag('max_model_len')} auto sets the context once the memory is profiled, and a step "
                              f"must hold a whole prompt without chunked prefill, so the token budget would have to "
                              f"follow it; pass --enable-chunked-prefill, or give a length.")

        on_cuda = device.type == "cuda"
        batched = parse_size(self.max_num_batched_tokens, "max_num_batched_tokens")
        if batched is None:
            batched = (8192 if on_cuda else 2048) if self.enable_chunked_prefill else max(max_model_len, 2048)
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = min(256 if on_cuda else 128, batched)
        check_step_limits(max_num_seqs, batched, max_model_len, self.enable_chunked_prefill)
        mixed = self.max_mixed_prefill_tokens
        if mixed is None:
            mixed = 256 if serving else 0
        if not isinstance(mixed, int) or isinstance(mixed, bool) or mixed < 0:
            raise ConfigError(f"{flag('max_mixed_prefill_tokens')}: {mixed!r} must be an integer >= 0 (0: no bound).")

        if self.max_logprobs < -1:
            raise ConfigError(f"{flag('max_logprobs')}: {self.max_logprobs} must be >= 0, or -1 for the vocabulary's "
                              f"size.")
        max_logprobs = m.vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, m.vocab_size)

        capture = parse_size(self.max_cudagraph_capture_size, "max_cudagraph_capture_size")
        if capture is None:
            capture = DEFAULT_CAPTURE_SIZE
        elif capture < 0:
            raise ConfigError(f"{flag('max_cudagraph_capture_size')}: {capture} must be >= 0 (0: steps with prompt "
                              f"tokens are never replayed as graphs).")

        kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        if kv_cache_memory is not None and kv_cache_memory <= 0:
            raise ConfigError(f"{flag('kv_cache_memory')}: {kv_cache_memory} must be positive.")
        if kv_cache_memory is None and device.type == "cpu" and self.num_gpu_blocks_override is None:
            kv_cache_memory = 2**30
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ConfigError(f"{flag('num_gpu_blocks_override')}: must be positive.")

        return EngineConfig(
            args=self, source=source, model=model_config, device=device, dtype=dtype, kv_dtype=kv_dtype,
            max_model_len=max_model_len, fit_to_cache=fit_to_cache, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_mixed_prefill_tokens=mixed if self.enable_chunked_prefill else 0, kv_cache_memory=kv_cache_memory,
            generation=generation, max_cudagraph_capture_size=min(capture, batched), max_logprobs=max_logprobs,
        )

    def _resolve_device(self) -> torch.device:
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name not in ("cuda", "cpu"):
            raise ConfigError(f"{flag('device')}: {self.device!r} is not one of auto, cuda, cpu.")
        if name == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag('device')}: cuda was asked for but torch sees no GPU; use --device cpu.")
        return torch.device("cuda", torch.cuda.current_device())

    def _resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        name = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if name == "auto":
            if device.type == "cpu":
                return torch.float32
            name = model.torch_dtype if model.torch_dtype in ("float16", "bfloat16") else "bfloat16"
        if name not in _DTYPES:
            raise ConfigError(f"{flag('dtype')}: {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}.")
        return _DTYPES[name]

    def _resolve_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        name = _DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if name == "auto":
            return dtype
        if name in _DTYPES:
            return _DTYPES[name]
        if name in _KV_DTYPES:
            return _KV_DTYPES[name]
        raise ConfigError(
            f"{flag('kv_cache_dtype')}: {self.kv_cache_dtype!r} is not one of auto, "
            f"{', '.join([*_DTYPES, *_KV_DTYPES])}.")


# the fields that also take a size as text (8k, 4GiB)
_SIZE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineArgs) if f.metadata.get("size"))


@dataclass(frozen=True)
class EngineConfig:
    """Resolved configuration: every field is final."""

    args: EngineArgs
    source: ModelSource
    model: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    fit_to_cache: bool  # --max-model-len auto: max_model_len is the model's until the KV cache is sized
    max_num_seqs: int
    max_num_batched_tokens: int
    max_mixed_prefill_tokens: int  # 0: no bound on prompt tokens beside decodes
    kv_cache_memory: int | None
    generation: GenerationDefaults
    max_cudagraph_capture_size: int  # the largest step with prompt tokens that replays a graph (0: none)
    max_logprobs: int  # the most top logprobs a request may ask for a token (at most the vocabulary)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.args.enable_chunked_prefill

    @property
    def blocks_per_max_len_request(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def check_runtime_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Limits a running engine may switch to (degradation profiles): the start-up rules, and never above
        what start-up sized for (the activation peak was measured at max_num_batched_tokens, the sampler
        and the CUDA graphs at max_num_seqs)."""
        check_step_limits(max_num_seqs, max_num_batched_tokens, self.max_model_len, self.enable_chunked_prefill)
        for name, value, ceiling in (("max_num_seqs", max_num_seqs, self.max_num_seqs),
                                     ("max_num_batched_tokens", max_num_batched_tokens, self.max_num_batched_tokens)):
            if value > ceiling:
                raise ConfigError(f"{flag(name)}: {value} is above the {ceiling} the engine started with, which its "
                                  f"memory budget was profiled for; restart with {option(name)} {value} "
                                  f"to allow it.")
