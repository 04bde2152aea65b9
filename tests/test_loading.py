"""Config and checkpoint validation: user mistakes are clear errors that name the problem."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rarecache.errors import RarecacheError
from rarecache.models.config import ModelConfig
from rarecache.models.loader import load_model

from .conftest import make_tiny


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (path / "config.json").write_text(json.dumps(raw))


def test_config_fields(tmp_path):
    make_tiny("qwen3", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.family, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", 24, True, False)
    assert cfg.kv_dim == 48
    with pytest.raises(dataclasses.FrozenInstanceError, match="^cannot assign to field 'num_layers'$"):
        cfg.num_layers = 4  # frozen


def test_legacy_rope_keys():
    cfg = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        unknown_key="dropped"))
    assert cfg.rope.theta == 500000.0 and cfg.rope.type == "llama3" and cfg.num_kv_heads == 2


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=None), "missing required key 'hidden_size'"),
    (dict(model_type="gpt2"), "unsupported model_type 'gpt2'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "unsupported RoPE type 'yarn'"),
])
def test_bad_config_is_a_clear_error(tmp_path, change, message):
    make_tiny("qwen2", tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(RarecacheError, match=message):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size="64"), "hidden_size must be an integer"),
    (dict(hidden_size=64.5), "hidden_size must be an integer"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be an integer"),
    (dict(num_hidden_layers=0), "num_layers must be an integer in 1"),
    (dict(num_hidden_layers=10**9), "at most 1024"),
    (dict(vocab_size=10**400), "vocab_size"),
    (dict(num_key_value_heads=3), "do not split"),
    (dict(head_dim=15), "odd"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite number"),
    (dict(rope_parameters="x"), "rope_parameters"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_theta must be a number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}), "rope theta"),
    (dict(rope_parameters={"rope_type": ["llama3"]}), "unsupported RoPE type"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    (dict(eos_token_id=["a"]), "eos token ids"),
    (dict(eos_token_id={"x": 1}), "eos token ids"),
])
def test_bad_config_values_are_clear_errors(tmp_path, change, message):
    """config.json is untrusted: a wrong type or an out-of-range value is a RarecacheError naming the key
    (not a ValueError, a TypeError, or a model built with a billion layers)."""
    make_tiny("qwen2", tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(RarecacheError, match=message):
        load_model(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    make_tiny("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, file)
    with pytest.raises(RarecacheError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight.*"
                                             r"unexpected tensors: model\.layers\.1\.mlp\.extra\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    make_tiny("qwen2", tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, file)
    with pytest.raises(RarecacheError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_tiny("qwen3", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_model(tmp_path / "one"), load_model(tmp_path / "sharded")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_shard_outside_directory_is_refused(tmp_path):
    make_tiny("qwen2", tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(RarecacheError, match="outside the directory"):
        load_model(tmp_path)


def test_not_a_safetensors_file(tmp_path):
    make_tiny("qwen2", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(RarecacheError, match="cannot read"):
        load_model(tmp_path)
