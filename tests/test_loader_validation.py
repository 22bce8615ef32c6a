"""Checkpoint loading refuses what would only fail later (or silently): non-finite or negative
config values, an index that maps a tensor to the wrong file, a device that does not exist; and
each error names the file and the key once."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llama_checkpoints import make_checkpoint  # noqa: E402

from treeattn.models.llama import LlamaConfig  # noqa: E402
from treeattn.models.loader import load_model  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("loader") / "llama"
    make_checkpoint("llama", directory)
    return directory


@pytest.fixture
def broken(checkpoint, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    return directory


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))  # json writes NaN and Infinity, as Python's json reads them


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
         "rope_theta must be a finite positive number, got nan"),
        (dict(rope_parameters=None, rope_theta=float("nan")), "rope_theta must be a finite positive number, got nan"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -5.0}),
         "rope_theta must be a finite positive number, got -5.0"),
        (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite positive number, got -1e-06"),
        (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite positive number, got inf"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": float("nan")}),
         "rope_scaling.factor must be a finite positive number"),
        (dict(max_position_embeddings=0), "max_position_embeddings must be a positive int, got 0"),
        (dict(hidden_size=66, head_dim=None), "hidden_size 66 is not a multiple of num_attention_heads 4, and no 'head_dim' key"),
    ],
)
def test_bad_values_are_refused_at_load(broken, changes, match):
    _edit_config(broken, **changes)
    with pytest.raises(ValueError, match=match) as info:
        load_model(broken)
    assert str(info.value).count("config.json") == 1, str(info.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(vocab_size=None), "missing required key 'vocab_size'"),
        (dict(architectures=None, model_type="gpt2"), "unsupported model_type 'gpt2' (key 'model_type'; no 'architectures' key); "
                                                      "supported: llama, qwen2, mistral"),
        (dict(architectures=None, model_type=None), "neither 'architectures' nor 'model_type' says which model this is"),
        (dict(architectures=None, model_type="llama"), None),  # model_type alone is enough
    ],
)
def test_config_errors_name_the_file_once_and_the_right_key(broken, changes, message):
    _edit_config(broken, **changes)
    if message is None:
        assert load_model(broken).config.architecture == "LlamaForCausalLM"
        return
    with pytest.raises(ValueError) as info:
        load_model(broken)
    assert str(info.value).startswith(f"{broken / 'config.json'}: {message}"), str(info.value)
    assert str(info.value).count("config.json") == 1


def test_config_values_are_checked_for_every_loader():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="rms_norm_eps must be a finite positive number"):
        LlamaConfig(**base, rms_norm_eps=float("nan"))
    with pytest.raises(ValueError, match="rope_theta must be a finite positive number"):
        LlamaConfig(**base, rope_theta=0.0)


def test_an_index_mapping_a_tensor_to_the_wrong_file_names_both(broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    (broken / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:5]}, broken / "a.safetensors")
    save_file({k: tensors[k] for k in names[5:]}, broken / "b.safetensors")
    weight_map = {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(names)}
    weight_map[names[7]] = "a.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError) as info:
        load_model(broken)
    assert str(info.value) == (f"{broken / 'model.safetensors.index.json'}: maps tensor {names[7]!r} to a.safetensors, "
                               "which does not hold it (it is in b.safetensors)")
    weight_map[names[7]] = "b.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_model(broken).config.num_layers == 2


@pytest.mark.parametrize("device", ["foo", "cuda:99" if torch.cuda.is_available() else "cuda", 7])
def test_a_device_that_does_not_exist_is_named_before_reading(checkpoint, device):
    with pytest.raises(ValueError, match=rf"device.*{device!r}"):
        load_model(checkpoint, device=device)



@pytest.mark.parametrize("rope", [dict(rope_theta=float("nan")), dict(factor=-4.0), dict(mscale=float("inf"))])
def test_deepseek_configs_are_checked_the_same_way(rope):
    from helpers.deepseek_checkpoints import COMMON, YARN

    from treeattn.models.loader import config_from_dict

    raw = dict(COMMON, architectures=["DeepseekV3ForCausalLM"], q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1)
    assert config_from_dict(dict(raw, rope_parameters=dict(YARN, mscale=0.0))).rope_type == "yarn"  # YaRN's mscale may be 0
    with pytest.raises(ValueError, match="must be a finite (positive )?number"):
        config_from_dict(dict(raw, rope_parameters=dict(YARN, **rope)))
    with pytest.raises(ValueError, match="rms_norm_eps must be a finite positive number, got -1e-06"):
        config_from_dict(dict(raw, rms_norm_eps=-1e-6))
