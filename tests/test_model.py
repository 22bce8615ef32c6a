"""The Llama-family model and the checkpoint loader against Hugging Face transformers (the oracle).

Tiny random-weight LlamaForCausalLM (Llama 3 rope scaling, attention bias), Qwen2ForCausalLM (q/k/v
bias, tied embeddings) and MistralForCausalLM (sliding window shorter than the prompt) are saved
with save_pretrained (safetensors) and loaded with treeattn; prefill logits must agree to 1e-4.
The checkpoints come from tests/helpers/llama_checkpoints.py (the decoding tests use them too).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn.cache import ShardedKVCache  # noqa: E402
from treeattn.models import LocalAttention, load_model, load_tokenizer, read_config  # noqa: E402
from helpers.llama_checkpoints import VOCAB, ARCHS, make_checkpoint, treeattn_logits  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: (root / arch, make_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_logits_match_transformers(checkpoints, arch):
    directory, hf = checkpoints[arch]
    model = load_model(directory)
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    got = treeattn_logits(model, ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert expected[0, -1].std() > 0.1  # the logits are not trivially flat


def test_config_features_are_read(checkpoints):
    llama = read_config(checkpoints["llama"][0])
    assert llama.rope_type == "llama3" and llama.rope_scaling["factor"] == 8.0 and llama.qkv_bias and llama.o_bias
    qwen = read_config(checkpoints["qwen2"][0])
    assert qwen.tie_word_embeddings and qwen.qkv_bias and not qwen.o_bias
    mistral = read_config(checkpoints["mistral"][0])
    assert mistral.layer_windows == (8, 8) and mistral.head_dim == 16


def test_chunked_prefill_and_decode_steps_give_the_same_logits(checkpoints):
    """Prefill in chunks of 5 and then token by token: the logits of every position are unchanged."""
    directory, _ = checkpoints["mistral"]
    model = load_model(directory)
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(2))
    whole = treeattn_logits(model, ids)
    cfg = model.config
    cache = ShardedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, capacity=17)
    pieces = []
    with torch.inference_mode():
        for start, stop in ((0, 5), (5, 10), (10, 15), (15, 16), (16, 17)):
            positions = torch.arange(start, stop).unsqueeze(0)
            slots = cache.extend(positions)
            pieces.append(model.logits(model(ids[:, start:stop], positions, cache.update(slots), LocalAttention(), chunk=2)))
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=0)


def test_sharded_checkpoint_with_index_loads_the_same_weights(checkpoints, tmp_path):
    _, hf = checkpoints["llama"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    single = load_model(checkpoints["llama"][0])
    sharded = load_model(tmp_path)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_dtype_and_device_options(checkpoints):
    model = load_model(checkpoints["qwen2"][0], dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32  # RoPE angles stay float32
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    full = treeattn_logits(load_model(checkpoints["qwen2"][0]), ids)
    torch.testing.assert_close(treeattn_logits(model, ids), full, atol=0.15, rtol=0.05)


def test_tokenizer_is_optional_and_checked(checkpoints, tmp_path):
    assert load_tokenizer(checkpoints["llama"][0]) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


# ------------------------------------------------------------------------------------ bad input


@pytest.fixture
def broken(checkpoints, tmp_path):
    """A fresh copy of the llama checkpoint to damage."""
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"][0], directory)
    return directory


def _edit_config(directory: Path, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_missing_directory_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"config.json: no such file"):
        load_model(tmp_path)


def test_malformed_config(broken):
    (broken / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        load_model(broken)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(architectures=["GPT2LMHeadModel"]), r"config.json: unsupported architecture 'GPT2LMHeadModel'"),
        (dict(hidden_size=None), r"config.json: missing required key 'hidden_size'"),
        (dict(num_attention_heads="four"), r"config.json: key 'num_attention_heads' must be int, got 'four'"),
        (dict(hidden_act="gelu"), r"unsupported hidden_act 'gelu'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), r"unsupported rope type 'yarn'"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}),
         r"needs a number rope_parameters.low_freq_factor"),
        (dict(num_key_value_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ],
)
def test_bad_config_values_are_named(broken, changes, match):
    _edit_config(broken, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(broken)


def test_shape_disagreeing_with_config_names_the_tensor(broken):
    _edit_config(broken, intermediate_size=80)
    with pytest.raises(ValueError,
                       match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' has shape \((96, 64|64, 96)\), "
                             r"but config.json implies \((80, 64|64, 80)\)"):
        load_model(broken)


def test_missing_and_unexpected_tensors(broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. model.layers.1.self_attn.k_proj.weight"):
        load_model(broken)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not have: 'model.layers.0.mlp.extra.weight' in model.safetensors"):
        load_model(broken)


def test_missing_or_malformed_weights(broken):
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match=r"model.safetensors: not a valid safetensors file"):
        load_model(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights"):
        load_model(broken)


def test_index_naming_a_missing_shard(broken):
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "shard-2.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"tensor 'model.norm.weight' is in 'shard-2.safetensors', which does not exist"):
        load_model(broken)
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weights": {}}))
    with pytest.raises(ValueError, match=r"index.json: expected a 'weight_map' object"):
        load_model(broken)


def test_the_loaders_meta_skeleton_runs_no_random_init(checkpoints, monkeypatch):
    # nn.Embedding's init (normal_) on "meta" imports torch._dynamo on its first call: ~2 s of every
    # load in every process, for values the loader replaces. The skeleton skips it; a CPU model does not.
    from treeattn.models.loader import check_checkpoint
    from treeattn.models.llama import LlamaModel

    calls = []
    monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *args, **kwargs: calls.append(tuple(tensor.shape)))
    for arch, (directory, _) in checkpoints.items():
        skeleton = check_checkpoint(directory)
        assert skeleton.embed_tokens.weight.is_meta and skeleton.embed_tokens.weight.requires_grad, arch
        assert tuple(skeleton.embed_tokens.weight.shape) == (skeleton.config.vocab_size, skeleton.config.hidden_size)
    assert calls == []
    LlamaModel(skeleton.config)  # on the CPU the embedding is initialized as nn.Embedding does
    assert calls == [(skeleton.config.vocab_size, skeleton.config.hidden_size)]
    model = load_model(directory)
    assert calls == [(skeleton.config.vocab_size, skeleton.config.hidden_size)] and not model.embed_tokens.weight.is_meta
