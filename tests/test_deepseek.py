"""DeepSeek-V2/V3 (multi-head latent attention, MoE) against transformers' own implementation.

Tiny random checkpoints written by save_pretrained (MoE layers, YaRN, q_lora_rank set and None,
the V3 and both V2 routers): prefill logits in the absorbed and the naive form within 1e-4 of
transformers; greedy tokens on p = 1, 2, 3 (tree and ring decoding, ring and split prefill) equal
to transformers' uncached greedy recomputation (a full forward pass per new token); the latent
cache holds one (kv_lora_rank + qk_rope_head_dim) entry per token and layer, values a view of it;
unimplemented config features and mismatched latent dims fail in one line naming the key.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers")  # not imported: the ranks import this module too

from treeattn.cache import ShardedKVCache  # noqa: E402
from treeattn.cache.sharded import kv_bytes_per_token  # noqa: E402
from treeattn.engine.generate import generate  # noqa: E402
from treeattn.models import load_model  # noqa: E402
from treeattn.models.attention import LocalAttention  # noqa: E402
from treeattn.models.deepseek import DeepseekModel, prefers_naive  # noqa: E402
from treeattn.parallel import spawn  # noqa: E402
from helpers.deepseek_checkpoints import VOCAB, NEW_TOKENS, PROMPT, COMMON, ARCHS, make_checkpoint, uncached_greedy  # noqa: E402


def local_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """All-position logits (B, S, V) on one process, prefilled in one pass through a latent cache."""
    c = model.config
    cache = ShardedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                           value_dim=c.cache_value_dim, capacity=ids.shape[1], batch_size=ids.shape[0])
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    slots = cache.extend(positions)
    with torch.inference_mode():
        return model.logits(model(ids, positions, cache.update(slots), LocalAttention()))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: (root / arch, make_checkpoint(arch, root / arch)) for arch in ARCHS}


@pytest.mark.parametrize("form", ["absorbed", "naive"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_logits_match_transformers(checkpoints, arch, form):
    directory, hf = checkpoints[arch]
    model = load_model(directory)
    assert isinstance(model, DeepseekModel) and model.config.architecture == ARCHS[arch][1]
    model.attention_form = form
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(local_logits(model, ids), expected, atol=1e-4, rtol=0)


def test_moe_layers_route_to_several_experts(checkpoints):
    """The checkpoints exercise what the test claims: MoE layers whose router picks varied experts."""
    model = load_model(checkpoints["v3"][0])
    moe = model.layers[1].mlp
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, index = moe.gate(x)
    assert index.shape == (40, 3) and index.unique().numel() >= 6
    assert torch.allclose(weights.sum(-1), torch.full((40,), 2.5))  # normalized, times routed_scaling_factor
    # the router's correction bias stays float32, as in transformers
    bf16 = load_model(checkpoints["v3"][0], dtype=torch.bfloat16)
    assert bf16.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32 and bf16.norm.weight.dtype == torch.bfloat16


def test_latent_cache_layout_and_bytes(checkpoints):
    model = load_model(checkpoints["v3"][0])
    c = model.config
    cache = ShardedKVCache(num_layers=c.num_layers, num_kv_heads=1, head_dim=c.head_dim, value_dim=c.cache_value_dim, capacity=8)
    cache.extend(torch.arange(5))
    k, v = cache.layer(0)
    assert k.shape == (1, 5, 1, 16 + 8) and v.shape == (1, 5, 1, 16)
    assert v.data_ptr() == k.data_ptr()  # the values are the latent part of the keys, no storage of their own
    assert cache.bytes_per_token == kv_bytes_per_token(c, torch.float32) == 3 * (16 + 8) * 4
    assert cache.nbytes() == 5 * (cache.bytes_per_token + 8)
    with pytest.raises(ValueError, match="value_dim must be None or an int in"):
        ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=8, value_dim=9, capacity=4)


def test_prefers_naive_only_for_long_query_blocks(checkpoints):
    c = load_model(checkpoints["v3"][0]).config
    assert not prefers_naive(1, 4096, c)
    assert prefers_naive(512, 512, c)


@pytest.fixture(scope="module")
def references(checkpoints):
    return {arch: uncached_greedy(hf, PROMPT) for arch, (_, hf) in checkpoints.items() if arch in ("v3", "v2")}


# (decode, method, placement, prefill) per number of ranks
CASES = {
    1: [("tree", "allreduce", "contiguous", "auto")],
    2: [("tree", "allreduce", "interleaved", "auto"), ("ring", "allreduce", "contiguous", "split")],
    3: [("tree", "tree", "contiguous", "auto"), ("tree", "allreduce", "interleaved", "split"),
        ("ring", "allreduce", "interleaved", "auto")],
}


def _ranks(rank: int, world_size: int, dirs: dict) -> dict:
    torch.set_num_threads(1)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    models = {arch: load_model(directory) for arch, directory in dirs.items()}
    out = {}
    for p, cases in CASES.items():
        if rank >= p:
            continue
        for arch, model in models.items():
            for decode, method, placement, prefill in cases:
                result = generate(model, PROMPT, max_new_tokens=NEW_TOKENS, decode=decode, method=method, placement=placement,
                                  prefill=prefill, block_size=4, group=groups[p])
                out[(arch, p, decode, method, placement, result.prefill)] = result.generated_ids[0]
                out[("kv_bytes_per_token", arch)] = result.kv_bytes_per_token
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints):
    dirs = {arch: str(checkpoints[arch][0]) for arch in ("v3", "v2")}
    return spawn(_ranks, 3, dirs, timeout=300)


def test_every_case_ran(ranks):
    expected = {(arch, p, *case[:3]) for arch in ("v3", "v2") for p, cases in CASES.items() for case in cases}
    assert {key[:5] for key in ranks[0] if key[0] != "kv_bytes_per_token"} == expected


def test_greedy_tokens_equal_uncached_transformers_on_every_p(ranks, references):
    for rank, out in enumerate(ranks):
        for key, tokens in out.items():
            if key[0] != "kv_bytes_per_token":
                assert tokens == references[key[0]], (rank, key)


def test_kv_bytes_per_token_reported(ranks):
    c = COMMON
    latent = c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    assert ranks[0][("kv_bytes_per_token", "v3")] == latent
    # a GQA model of the same width would keep 2 * layers * Hkv * head_dim floats: 8x more here even at Hkv = 2
    assert 2 * c["num_hidden_layers"] * 2 * (c["hidden_size"] // c["num_attention_heads"]) * 4 > latent


def _rewrite_config(directory, tmp_path, **changes):
    """A copy of checkpoint `directory` with config.json keys changed (None deletes)."""
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    raw = json.loads((target / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (target / "config.json").write_text(json.dumps(raw))
    return target


@pytest.mark.parametrize("arch, changes, match", [
    ("v3", dict(quantization_config={"quant_method": "fp8"}), r"quantization_config='fp8' is not implemented"),
    ("v3", dict(moe_layer_freq=2), r"moe_layer_freq=2 is not implemented"),
    ("v3", dict(scoring_func="softmax"), r"scoring_func='softmax' is not implemented"),
    ("v3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
     r"rope_parameters.rope_type='linear' is not implemented .*default, yarn"),
    ("v3", dict(hidden_act="gelu"), r"hidden_act='gelu' is not implemented"),
    ("v2", dict(topk_method="noaux_tc"), r"topk_method='noaux_tc' is not implemented for DeepseekV2ForCausalLM"),
    ("v2", dict(norm_topk_prob=True), r"norm_topk_prob=True is not implemented"),
    ("v3", dict(kv_lora_rank="16"), r"key 'kv_lora_rank' must be int, got '16'"),
    ("v3", dict(n_group=3), r"n_routed_experts \(8\) must be a multiple of n_group \(3\)"),
])
def test_unimplemented_or_bad_config_names_the_key(checkpoints, tmp_path, arch, changes, match):
    directory = _rewrite_config(checkpoints[arch][0], tmp_path, **changes)
    with pytest.raises(ValueError, match=match) as info:
        load_model(directory)
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


@pytest.mark.parametrize("key, value, tensor", [
    ("kv_lora_rank", 12, "kv_a_proj_with_mqa.weight"),
    ("qk_rope_head_dim", 4, "kv_a_proj_with_mqa.weight"),
    ("v_head_dim", 10, "kv_b_proj.weight"),
])
def test_mismatched_latent_dims_name_the_tensor_and_key(checkpoints, tmp_path, key, value, tensor):
    directory = _rewrite_config(checkpoints["v3"][0], tmp_path, **{key: value})
    with pytest.raises(ValueError, match=rf"tensor 'model\.layers\.0\.self_attn\.[a-z_]+\.weight' has shape .*{key}") as info:
        load_model(directory)
    assert "\n" not in str(info.value)


def test_mtp_layers_of_the_checkpoint_are_ignored(checkpoints, tmp_path):
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers extra layers (multi-token prediction)."""
    from safetensors.torch import load_file, save_file

    directory = _rewrite_config(checkpoints["v3"][0], tmp_path, num_nextn_predict_layers=1)
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    model = load_model(directory)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(local_logits(model, ids), checkpoints["v3"][1](ids).logits, atol=1e-4, rtol=0)


def test_engine_takes_the_checkpoint_unchanged(checkpoints, references):
    """ta.Engine on 2 ranks (tree decoding, paged latent cache): greedy tokens of two requests batched
    together equal transformers' uncached recomputation."""
    import treeattn as ta

    short = PROMPT[:7]
    expected = [references["v3"], uncached_greedy(checkpoints["v3"][1], short)]
    with ta.Engine(str(checkpoints["v3"][0]), nproc=2, decode="tree", placement="interleaved", block_size=4,
                   cache_tokens=128, timeout_s=60) as engine:
        results = engine.generate([PROMPT, short], max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.token_ids for r in results] == expected


def test_cli_generate_reports_kv_bytes_per_token(checkpoints, references, tmp_path):
    from typer.testing import CliRunner

    from treeattn.cli import app

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    result = CliRunner().invoke(app, ["generate", str(checkpoints["v2"][0]), "--prompt-ids", str(ids), "--max-new-tokens",
                                      str(NEW_TOKENS), "--no-stop", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["generated_ids"] == references["v2"]
    assert report["kv_bytes_per_token"] == COMMON["num_hidden_layers"] * (COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]) * 4


def test_shared_context_samples_and_static_step(checkpoints, references):
    """num_samples > 1 (bifurcated attention over the latent cache): greedy samples all equal the
    reference; the static (graph-safe) step is refused before any work, naming the model class."""
    model = load_model(checkpoints["v3"][0])
    result = generate(model, PROMPT, max_new_tokens=NEW_TOKENS, num_samples=2, ignore_eos=True)
    assert result.generated_ids == [references["v3"]] * 2
    with pytest.raises(ValueError, match="decode_step='static' cannot run this model .*LlamaModel only, not DeepseekModel"):
        generate(model, PROMPT, max_new_tokens=2, decode_step="static")


def test_the_loaders_meta_skeleton_runs_no_random_init(checkpoints, monkeypatch):
    from treeattn.models.loader import check_checkpoint

    calls = []
    monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *args, **kwargs: calls.append(tuple(tensor.shape)))
    for directory, _ in checkpoints.values():
        skeleton = check_checkpoint(directory)
        assert skeleton.embed_tokens.weight.is_meta and tuple(skeleton.embed_tokens.weight.shape) == (
            VOCAB,
            skeleton.config.hidden_size,
        )
    assert calls == []
