"""Build the model on its device and fill its weights: from *.safetensors, or random (``dummy``)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.config import ConfigError, EngineConfig, flag, read_json
from pagedserve.memory import kv_heads_per_rank
from pagedserve.model.attention import AttentionBackend
from pagedserve.model.decoder import PACKED_WEIGHTS, DecoderForCausalLM
from pagedserve.model.parallel import tp

logger = logging.getLogger(__name__)


def build_model(config: EngineConfig, backend: AttentionBackend) -> DecoderForCausalLM:
    """Parameters are created directly on the device in the model dtype (no float32 copy on the way)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(config.device):
            model = DecoderForCausalLM(config.model, backend, max_positions=config.max_model_len)
    finally:
        torch.set_default_dtype(previous)
    if config.args.load_format == "dummy":
        _init_dummy(model, config.args.seed)
    else:
        if config.source.path is None:
            raise ConfigError(f"{flag('load_format')}: {config.source.name} has no weights here; use --load-format dummy.")
        load_safetensors(model, config.source.path)
    return model.eval()


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights drawn on the model's device (an 8B model initialises in seconds on a GPU)."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "model").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{flag('model')}: {str(index)!r} has no weight_map (tensor name -> shard file).")
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{flag('model')}: no *.safetensors in {str(path)!r}. Convert the checkpoint to safetensors, "
            f"or pass --load-format dummy for random weights.")
    return files


@torch.no_grad()
def load_safetensors(model: DecoderForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tied = model.config.tie_word_embeddings
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if "rotary_emb" in hf_name or (tied and hf_name == "lm_head.weight"):
                    continue
                tensor = _rank_slice(hf_name, f.get_slice(hf_name), model.config)
                name, expert, shard = _map_name(hf_name)
                if name not in params:
                    raise ConfigError(f"checkpoint tensor {hf_name!r} in {file.name} has no place in this "
                                      f"{model.config.model_type} model: is config.json the right one?")
                target = params[name]
                if expert is not None:
                    if expert >= len(target):
                        raise ConfigError(f"checkpoint tensor {hf_name!r} names expert {expert}; config.json gives "
                                          f"{len(target)}.")
                    target = target[expert]
                if shard is not None:
                    sizes = model.shard_sizes(name.split(".")[-1 if expert is not None else -2])
                    target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
                if target.shape != tensor.shape:
                    raise ConfigError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                      f"expected {tuple(target.shape)}: config.json does not match the weights.")
                target.copy_(tensor)
                loaded.update(_pieces(name, params[name], expert, shard, model))
    expected = {piece for name, p in params.items() for piece in _pieces(name, p, None, None, model)}
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(f"checkpoint in {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}.")


_PACKED = ("qkv_proj", "gate_up_proj", "w13")


def _pieces(name: str, tensor: torch.Tensor, expert: int | None, shard: int | None, model) -> list[str]:
    """The pieces of parameter ``name`` a checkpoint tensor fills, as "name#expert#shard": one shard of a merged
    tensor, or all of them where the checkpoint has it merged too (Phi-3's qkv_proj and gate_up_proj); of a stacked
    experts' tensor, one expert's (``expert`` None: every expert, the pieces a whole load must fill)."""
    last = name.split(".")[-1]
    packed = name.split(".")[-2] if last in ("weight", "bias") else last
    pieces = [""]
    if last in ("w13", "w2"):
        pieces = [f"#{e}" for e in (range(len(tensor)) if expert is None else [expert])]
    if packed in _PACKED:
        shards = range(len(model.shard_sizes(packed))) if shard is None else [shard]
        pieces = [f"{piece}#{i}" for piece in pieces for i in shards]
    return [name + piece for piece in pieces]


def _rank_slice(hf_name: str, sl, cfg) -> torch.Tensor:
    """This tensor-parallel rank's part of a checkpoint tensor, read without loading the rest: rows of
    q/k/v, gate/up (an expert's too) and the vocabulary; columns of o_proj and down_proj (an expert's too). KV
    heads are replicated when there are fewer of them than ranks; a router is whole on every rank."""
    g = tp()
    if g.size == 1:
        return sl[:]
    d = cfg.head_dim
    q_rows = cfg.num_heads // g.size * d
    kv_local = kv_heads_per_rank(cfg, g.size)
    kv_first = g.rank * cfg.num_kv_heads // g.size
    if m := _EXPERT.search(hf_name):  # a slice of the expert's width, as of a dense MLP
        width = cfg.expert_intermediate_size // g.size
        start = g.rank * width
        return sl[start:start + width] if _EXPERT_PARTS[m.group(2)][0] == "w13" else sl[:, start:start + width]
    width = cfg.intermediate_size // g.size
    vocab = cfg.vocab_size // g.size
    rows = {".q_proj.": (g.rank * q_rows, q_rows), ".k_proj.": (kv_first * d, kv_local * d),
            ".v_proj.": (kv_first * d, kv_local * d), ".gate_proj.": (g.rank * width, width),
            ".up_proj.": (g.rank * width, width), "embed_tokens.": (g.rank * vocab, vocab),
            "lm_head.": (g.rank * vocab, vocab)}
    cols = {".o_proj.": (g.rank * q_rows, q_rows), ".down_proj.": (g.rank * width, width)}
    # tensors a checkpoint keeps merged (Phi-3): this rank's rows of each part, one after another
    merged = {".qkv_proj.": [(g.rank * q_rows, q_rows), (cfg.num_heads * d + kv_first * d, kv_local * d),
                             ((cfg.num_heads + cfg.num_kv_heads) * d + kv_first * d, kv_local * d)],
              ".gate_up_proj.": [(g.rank * width, width), (cfg.intermediate_size + g.rank * width, width)]}
    for part, spans in merged.items():
        if part in hf_name:
            return torch.cat([sl[start:start + n] for start, n in spans])
    for part, (start, n) in rows.items():
        if part in hf_name:
            return sl[start:start + n]
    for part, (start, n) in cols.items():
        if part in hf_name:
            return sl[:, start:start + n]
    return sl[:]


# an expert's tensor: Qwen3-MoE's mlp.experts.E.{gate,up,down}_proj, Mixtral's block_sparse_moe.experts.E.w{1,3,2}
_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PARTS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
                 "down_proj": ("w2", None), "w2": ("w2", None)}


def _map_name(hf_name: str) -> tuple[str, int | None, int | None]:
    """Our parameter for a checkpoint tensor, the expert it is one of (None: not an expert's), and its shard of
    a merged tensor (None: the whole of it)."""
    if m := _EXPERT.search(hf_name):
        param, shard = _EXPERT_PARTS[m.group(2)]
        return f"{hf_name[:m.start()]}.mlp.{param}", int(m.group(1)), shard
    hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router
    for part, (packed, shard) in PACKED_WEIGHTS.items():
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{packed}."), None, shard
    return hf_name, None, None
