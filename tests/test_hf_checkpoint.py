"""Bad Hugging Face checkpoints fail with one clear error naming the tensor, file or option."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from safetensors.numpy import load_file, save_file

from dora_jax import sharding as sh
from dora_jax.config import ModelConfig, TrainerMeshConfig
from dora_jax.mesh import make_mesh
from dora_jax.model import abstract_params, init_params, param_axes
from dora_jax.model.hf_checkpoint import (
    HFCheckpointError,
    load_hf_config,
    load_hf_params,
    save_hf_checkpoint,
)
from dora_jax.model.hf_mapping import UnsupportedModelError

CFG = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=False,
)


@pytest.fixture
def ckpt(tmp_path):
    params = init_params(CFG, jax.random.key(0))
    return save_hf_checkpoint(params, CFG, tmp_path / "ckpt"), params


def rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_round_trip_and_config(ckpt):
    path, params = ckpt
    cfg = load_hf_config(path)
    # The exported config states the resolved head_dim and the family's q/k/v bias.
    assert cfg == dataclasses.replace(CFG, head_dim=4, attention_bias=True)
    loaded = load_hf_params(path, cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_directly_into_shardings(ckpt):
    path, params = ckpt
    mesh = make_mesh(jax.devices()[:4], 2, 2)
    rules = sh.trainer_rules(TrainerMeshConfig(fsdp=True))
    shardings = sh.tree_shardings(param_axes(CFG), abstract_params(CFG), rules, mesh)
    loaded = load_hf_params(path, CFG, shardings)
    wq = loaded["layers"]["wq"]
    assert isinstance(wq.sharding, NamedSharding) and wq.sharding.spec[2] == "model"
    # Each device holds only its slice (embed over data, heads over model).
    assert wq.addressable_shards[0].data.shape == (2, 8, 2, 4)
    np.testing.assert_array_equal(np.asarray(wq), np.asarray(params["layers"]["wq"]))


def test_missing_tensor(ckpt):
    path, _ = ckpt
    rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(HFCheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up"):
        load_hf_params(path, CFG)


def test_wrong_shape(ckpt):
    path, _ = ckpt

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((4, 16), np.float32)

    rewrite(path, shrink)
    with pytest.raises(
        HFCheckpointError,
        match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[4, 16\], "
        r"expected \[8, 16\]",
    ):
        load_hf_params(path, CFG)


def test_unexpected_tensor(ckpt):
    path, _ = ckpt
    rewrite(path, lambda t: t.update({"model.layers.0.mlp.experts.0.weight": np.zeros(2)}))
    with pytest.raises(
        HFCheckpointError, match=r"unexpected tensor\(s\) model\.layers\.0\.mlp\.ex"
    ):
        load_hf_params(path, CFG)


def test_truncated_file(ckpt):
    path, _ = ckpt
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_hf_params(path, CFG)


def test_missing_files(tmp_path):
    with pytest.raises(HFCheckpointError, match=r"config\.json: missing"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match=r"config\.json: not valid JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(HFCheckpointError, match=r"no \*\.safetensors files"):
        load_hf_params(tmp_path, CFG)


def test_index_pointing_to_missing_shard(ckpt):
    path, _ = ckpt
    names = list(load_file(str(path / "model.safetensors")))
    index = {"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"model-00002-of-00002\.safetensors: missing"):
        load_hf_params(path, CFG)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
            r"architecture MixtralForCausalLM is not supported \(supported: Qwen2ForCausalLM, "
            r"LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM",
        ),
        (
            {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},
            r"architecture Gemma2ForCausalLM is not supported \(supported: Qwen2ForCausalLM",
        ),
        (
            {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"},
            r"architecture Gemma3ForCausalLM is not supported \(supported: Qwen2ForCausalLM",
        ),
        (
            {"architectures": [], "model_type": "gemma2"},
            r"model_type 'gemma2' is not supported \(supported: Qwen2ForCausalLM",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
            r"rope type 'yarn' is not supported",
        ),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            r"full-attention layers must all come before the sliding-window ones",
        ),
    ],
)
def test_unsupported_architecture(ckpt, change, message):
    path, _ = ckpt
    hf = json.loads((path / "config.json").read_text())
    hf.update(change)
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match=message):
        load_hf_config(path)
