"""Loading real checkpoint folders: sharded safetensors, dtypes, and broken folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.builtin.tiny import write_random_checkpoint
from tests.conftest import ARCH_CONFIGS

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, checkpoints):
    sharded = write_random_checkpoint(tmp_path / "sharded", ARCH_CONFIGS["qwen2"], seed=2, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = LLM(str(sharded), kv_cache_memory="4MiB").generate(["Hello world"], GREEDY, use_tqdm=False)
    b = LLM(str(checkpoints["qwen2"]), kv_cache_memory="4MiB").generate(["Hello world"], GREEDY, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids  # same seed, same weights


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_load_and_run(dtype, torch_dtype, checkpoints):
    llm = LLM(str(checkpoints["llama"]), dtype=dtype, kv_cache_memory="4MiB")
    assert next(llm.engine.core.worker.runner.model.parameters()).dtype == torch_dtype
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


def test_missing_tensor_is_reported(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["llama"], broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lacks 1 tensors.*up_proj"):
        LLM(str(broken), kv_cache_memory="4MiB")


def test_config_that_does_not_match_weights(tmp_path, checkpoints):
    broken = tmp_path / "mismatch"
    shutil.copytree(checkpoints["llama"], broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="does not match"):
        LLM(str(broken), kv_cache_memory="4MiB")


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ARCH_CONFIGS["llama"]))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        LLM(str(tmp_path), kv_cache_memory="4MiB")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**ARCH_CONFIGS["llama"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="Unsupported architecture"):
        LLM(str(tmp_path), kv_cache_memory="4MiB")


def test_dummy_weights_of_a_real_architecture():
    llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", num_gpu_blocks_override=16, max_model_len=256, dtype="bfloat16")
    params = sum(p.numel() for p in llm.engine.core.worker.runner.model.parameters())
    assert params == llm.engine.config.model.num_params()  # tied embeddings counted once
    assert 0.59e9 < params < 0.61e9


def test_a_mixture_of_experts_checkpoint_is_checked_expert_by_expert(tmp_path, checkpoints):
    """Each expert's tensors land in the layer's stacked weights: one missing is named, a checkpoint with more
    experts than config.json says is refused, and so are the settings its grouped GEMMs cannot run with."""
    from pagedserve.config import EngineArgs
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "missing"
    shutil.copytree(checkpoints["qwen3_moe"], broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lacks 1 tensors.*mlp\.w13#3#1"):
        LLM(str(broken), kv_cache_memory="4MiB")
    fewer = tmp_path / "fewer"
    shutil.copytree(checkpoints["mixtral"], fewer)
    cfg = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 2}))
    with pytest.raises(ConfigError, match="names expert 2; config.json gives 2"):
        LLM(str(fewer), kv_cache_memory="4MiB")
    with pytest.raises(ConfigError, match="2 must divide the experts' MLP width 33"):
        EngineArgs(model=str(checkpoints["qwen3_moe"]), hf_overrides={"moe_intermediate_size": 33},
                   tensor_parallel_size=2).create_config()
    many = {**json.loads((checkpoints["qwen3_moe"] / "config.json").read_text()), "num_experts_per_tok": 9}
    (tmp_path / "config.json").write_text(json.dumps(many))
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 is more than the 8 experts"):
        LLM(str(tmp_path), load_format="dummy", kv_cache_memory="4MiB")
    with pytest.raises(ConfigError, match="take bfloat16 on a GPU; use --dtype bfloat16"):
        EngineArgs(model="mistralai/Mixtral-8x7B-v0.1", dtype="float16").create_config(plan_for="cuda")
