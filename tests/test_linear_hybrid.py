"""Hybrid models (treeattn.linear.hybrid) and attention transfer (treeattn.linear.linearize).

A tiny random Llama (4 layers, GQA) with layers 1 and 3 linearized: prefill in one pass, in chunks
and token by token give the same logits (the linear layers continue from their O(1) state); on 2
gloo ranks, the softmax layers sharded and tree-decoded, the linear layers' states replicated with
no communication, the logits equal one process's. Training changes only the feature maps and
lowers the attention-transfer loss; maps round-trip through save/load; `treeattn linearize` runs
on a tiny GGUF. Tolerances: float32 forward passes that differ only in summation order.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.cache import ShardedKVCache
from treeattn.linear.hybrid import (HybridStore, LinearizedAttention, LinearStates, linear_layers, linearize_layers,
                                    load_feature_maps, save_feature_maps, softmax_index)
from treeattn.linear.linearize import attention_errors, linearize, record_attention, sequences
from treeattn.models.attention import LocalAttention, TreeAttention
from treeattn.models.llama import LlamaConfig, random_model

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
LINEAR = [1, 3]


def hybrid(seed: int = 0):
    model = random_model(LlamaConfig(**CONFIG), seed=seed, std=0.2)
    linearize_layers(model, LINEAR, feature_dim=6)
    with torch.no_grad():  # trained-looking maps, not the identity start
        for name, p in model.named_parameters():
            if "feature_map" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def run(model, ids, pieces, *, rank: int = 0, world: int = 1, group=None):
    """Logits of ids (1, S) fed in `pieces` (lengths), every rank running every token."""
    index = softmax_index(model)
    cache = ShardedKVCache(num_layers=len(index), num_kv_heads=CONFIG["num_kv_heads"], head_dim=CONFIG["head_dim"],
                           capacity=ids.shape[1], rank=rank, world_size=world, block_size=4)
    states, logits, start = LinearStates(), [], 0
    attend = LocalAttention() if group is None else TreeAttention(group=group)
    with torch.inference_mode():
        for n in pieces:
            positions = torch.arange(start, start + n).unsqueeze(0)
            slots = cache.extend(positions)
            store = HybridStore(cache.update(slots, slots.owned if world > 1 else None), states, index)
            logits.append(model.logits(model(ids[:, start:start + n], positions, store, attend)))
            start += n
    return torch.cat(logits, dim=1), cache, states


def test_hybrid_prefill_chunks_and_decode_agree():
    model = hybrid()
    assert linear_layers(model) == (1, 3) and softmax_index(model) == {0: 0, 2: 1}
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(1))
    whole, cache, states = run(model, ids, [23])
    chunked, _, _ = run(model, ids, [7, 9, 1, 6])
    stepped, _, states_after = run(model, ids, [10] + [1] * 13)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped, whole, atol=1e-5, rtol=0)
    # the cache holds the softmax layers only; the linear layers' state does not grow with the sequence
    assert cache.num_layers == 2
    short = run(model, ids[:, :3], [3])[2]
    assert states.nbytes() == short.nbytes() == 2 * (2 * 12 * 8 + 2 * 12) * 4
    # the linear layers really are linear: not the softmax model's logits
    plain = random_model(LlamaConfig(**CONFIG), seed=0, std=0.2)
    assert (run(plain, ids, [23])[0] - whole).abs().max() > 1e-3


def _two_rank_decode(rank: int, world: int, ids: torch.Tensor) -> torch.Tensor:
    model = hybrid()
    return run(model, ids, [9] + [1] * 8, rank=rank, world=world, group=dist.group.WORLD)[0]


def test_hybrid_on_two_ranks_matches_one_process():
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(2))
    single = run(hybrid(), ids, [17])[0]
    for logits in ta.spawn(_two_rank_decode, 2, ids):
        torch.testing.assert_close(logits, single, atol=1e-4, rtol=0)


def _greedy_recomputed(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from the whole sequence run again in one pass (no state carried over)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(run(model, torch.tensor([ids]), [len(ids)])[0][0, -1].argmax()))
    return ids[len(prompt):]


def test_the_engine_serves_a_hybrid_linear_model():
    """ta.Engine with the hybrid model: prompts in chunks of 8 (the linear states carried across
    chunks), three requests through a batch of two (prefill and decode in one step), on 2 gloo ranks
    (the softmax layers sharded, the linear states on every rank): the greedy tokens of a full
    recomputation; again after they are released (no prefix cache: it would need the states)."""
    model = hybrid()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (19, 6, 11)]
    expected = [_greedy_recomputed(model, p, 5) for p in prompts]
    with ta.Engine(model, nproc=2, block_size=4, cache_tokens=128, prefill_chunk=8, max_batch_size=2,
                   threads_per_rank=1) as engine:
        assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)] == expected
        assert engine.generate(prompts[:1], max_new_tokens=5)[0].token_ids == expected[0]
        assert engine.stats()["prefix_hit_tokens"] == 0 and engine.stats()["blocks_cached"] == 0


@pytest.mark.parametrize("option, message", [(dict(speculate="ngram"), "speculate='ngram' does not run a hybrid linear model"),
                                             (dict(decode_step="static"),
                                              "decode_step='static' does not run a hybrid linear model")])
def test_what_the_engine_cannot_run_with_linear_layers_is_refused_before_any_rank(option, message, tmp_path):
    """The same refusal, from one check (engine.checks.check_linear), for a loaded hybrid model and
    for a plain one whose --linear-maps directory names the layers to linearize."""
    with pytest.raises(ValueError, match=message):
        ta.Engine(hybrid(), nproc=2, **option)
    (tmp_path / "linear_layers.json").write_text(json.dumps({"layers": LINEAR, "feature_dim": 8}))  # read before any rank
    with pytest.raises(ValueError, match=re.escape(message) + r" \(linear layers \[1, 3\]\)"):
        ta.Engine(random_model(LlamaConfig(**CONFIG)), nproc=2, linear_maps=tmp_path, **option)


def test_linear_layer_needs_a_hybrid_store():
    model = hybrid()
    cache = ShardedKVCache(num_layers=4, num_kv_heads=2, head_dim=8, capacity=4)
    positions = torch.arange(4).unsqueeze(0)
    with pytest.raises(TypeError, match="kv_store of a hybrid model must be a treeattn.linear.HybridStore"):
        model(torch.zeros(1, 4, dtype=torch.long), positions, cache.update(cache.extend(positions)), LocalAttention())


def test_training_changes_only_the_maps_and_lowers_the_loss(tmp_path):
    model = random_model(LlamaConfig(**CONFIG), seed=3, std=0.2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    records = record_attention(model, sequences(ids, 32), LINEAR)  # the training text (a random model has no other)
    report = linearize(model, LINEAR, ids, seq_len=32, steps=20, lr=3e-2, batch=4)
    for i in LINEAR:
        assert report.loss_after[i] < 0.8 * report.loss_before[i], report
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before)  # every original weight unchanged
    errors = attention_errors(model, LINEAR, records)
    untrained = random_model(LlamaConfig(**CONFIG), seed=3, std=0.2)
    linearize_layers(untrained, LINEAR)
    identity = attention_errors(untrained, LINEAR, records)
    assert all(errors[i] < identity[i] for i in LINEAR), (errors, identity)

    save_feature_maps(model, tmp_path / "maps")
    fresh = random_model(LlamaConfig(**CONFIG), seed=3, std=0.2)
    assert load_feature_maps(fresh, tmp_path / "maps") == (1, 3)
    for (name, p), (name2, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert name == name2 and torch.equal(p, q)
    subset = random_model(LlamaConfig(**CONFIG), seed=3, std=0.2)
    assert load_feature_maps(subset, tmp_path / "maps", layers=[3]) == (3,) and linear_layers(subset) == (3,)
    with pytest.raises(ValueError, match=r"^layers: \[2\] have no trained maps"):
        load_feature_maps(random_model(LlamaConfig(**CONFIG)), tmp_path / "maps", layers=[2])
    with pytest.raises(FileNotFoundError, match="missing linear_layers.json"):
        load_feature_maps(fresh, tmp_path)
    with pytest.raises(ValueError, match=r"^layers must be distinct layer indices in \[0, 4\)"):
        linearize_layers(fresh, [4])


def test_linearize_command_on_a_tiny_gguf(tmp_path):
    pytest.importorskip("transformers")
    import gguf
    from gguf_files import write_gguf
    from helpers.gguf_models import hf_model
    from typer.testing import CliRunner

    from treeattn.cli import app

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.F16, context_length=256)
    text = tmp_path / "text.txt"
    text.write_text("the hat sat on the mat and the cat sat on the hat. " * 40)
    result = CliRunner().invoke(app, ["linearize", str(path), "--layers", "1", "--text", str(text), "--tokens", "256",
                                      "--seq-len", "64", "--steps", "5", "--out", str(tmp_path / "maps")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layers"] == [1] and set(report["loss_after"]) == {"1"}
    model = ta.load_model(path)
    assert load_feature_maps(model, tmp_path / "maps") == (1,)
    assert isinstance(model.layers[1].self_attn, LinearizedAttention)
    bad = CliRunner().invoke(app, ["linearize", str(path), "--layers", "1,x", "--text", str(text), "--out", str(tmp_path / "m2")])
    assert bad.exit_code == 2 and "--layers must be" in bad.output
    # the maps on the command line: treeattn generate --linear-maps serves the hybrid model through the engine,
    # with the tokens of ta.Engine on the model load_hybrid builds
    prompt = [5, 9, 14, 3, 7, 2, 11]
    with ta.Engine(model, nproc=1, block_size=16, cache_tokens=256) as engine:
        expected = engine.generate([prompt], max_new_tokens=4)[0].token_ids
    (tmp_path / "ids.json").write_text(json.dumps(prompt))
    generated = CliRunner().invoke(app, ["generate", str(path), "--linear-maps", str(tmp_path / "maps"), "--prompt-ids",
                                         str(tmp_path / "ids.json"), "--max-new-tokens", "4", "--nproc", "1", "--json"])
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout)["generated_ids"] == expected
    refused = CliRunner().invoke(app, ["generate", str(path), "--linear-maps", str(tmp_path), "--prompt-ids",
                                       str(tmp_path / "ids.json"), "--max-new-tokens", "4"])
    assert refused.exit_code == 2 and "--linear-maps" in refused.output and "linear_layers.json" in refused.output
