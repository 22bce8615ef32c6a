"""Shared-context sampling in the engine: generate(num_samples=n) and `treeattn generate --num-samples`.

n samples (n requests of the prompt in the engine: the prompt's full blocks prefilled once, shared
through the prefix cache, decoded with the shared-prefix attention) must give the same tokens as
decoding n copies of the prompt as a plain batch with the same seed, on one process and on 2 gloo
ranks.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import treeattn as ta
from treeattn.models import LlamaConfig, random_model

PROMPT = list(range(3, 40))  # 37 tokens
N = 5


def make_model():
    # GQA, and sliding windows that the decode steps cross (37 + 12 > 24). Both layers are windowed
    # (Mistral-like: the paged cache keeps every token): a window layer beside a global one makes a
    # hybrid cache, which has no prefix cache yet (docs/engine.md), and these samples share their
    # prompt through it.
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, layer_windows=(24, 24))
    return random_model(config, seed=1, std=0.2)


SAMPLING = dict(max_new_tokens=12, temperature=1.0, top_k=40, seed=3)
STOPS = dict(stop_token_ids=list(range(60, 75)), ignore_eos=True)  # some samples stop early, others run to max_new_tokens


def test_samples_equal_a_plain_batch_with_the_same_seed():
    model = make_model()
    samples = ta.generate(model, PROMPT, num_samples=N, **STOPS, block_size=8, **SAMPLING)
    batch = ta.generate(model, [PROMPT] * N, **STOPS, block_size=8, **SAMPLING)
    assert samples.num_samples == N and len(samples.generated_ids) == N
    assert samples.generated_ids == batch.generated_ids
    assert samples.finish_reasons == batch.finish_reasons
    assert len({len(ids) for ids in samples.generated_ids}) > 1, "the stop tokens should end some samples early"
    assert len(set(map(tuple, samples.generated_ids))) > 1, "temperature 1 should give different samples"
    for lp_s, lp_b, ids in zip(samples.token_logprobs, batch.token_logprobs, samples.generated_ids):
        assert len(lp_s) == len(ids)
        assert all(x <= 0 for x in lp_s)
        torch.testing.assert_close(torch.tensor(lp_s), torch.tensor(lp_b), rtol=0, atol=1e-4)
    for mean, lps in zip(samples.mean_logprobs, samples.token_logprobs):
        assert math.isclose(mean, sum(lps) / len(lps))
    order = samples.ranking()
    assert sorted(order) == list(range(N))
    assert [samples.mean_logprobs[i] for i in order] == sorted(samples.mean_logprobs, reverse=True)
    # the prompt's 4 full blocks (32 of its 37 tokens) are prefilled once: the other samples take them cached
    assert samples.cached_prompt_tokens == batch.cached_prompt_tokens == [0] + [32] * (N - 1)


def test_logprobs_are_the_models_own():
    """Each sample's first log-probability is log_softmax of the prompt's last logits at its token."""
    from treeattn.cache import ShardedKVCache
    from treeattn.models import LocalAttention

    model = make_model()
    result = ta.generate(model, PROMPT, num_samples=4, max_new_tokens=1, temperature=1.0, seed=0, ignore_eos=True)
    cfg = model.config
    cache = ShardedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, capacity=len(PROMPT))
    positions = torch.arange(len(PROMPT))[None]
    with torch.inference_mode():
        hidden = model(torch.tensor([PROMPT]), positions, cache.update(cache.extend(positions)), LocalAttention())
        expected = torch.log_softmax(model.logits(hidden[:, -1]).double(), dim=-1)[0]
    # The engine's log-probabilities are float32 (float32 logits, log_softmax in float32) and its
    # prompt pass runs other shapes than this one, so the bound is float32's (torch.testing's
    # defaults), not the float64 reference's: a fixed 1e-6 is ~9 float32 ulps at |x| ~ 4 and was
    # missed on another host's vector units.
    for ids, logprobs in zip(result.generated_ids, result.token_logprobs):
        torch.testing.assert_close(torch.tensor(logprobs[0], dtype=torch.float64), expected[ids[0]], rtol=1.3e-6, atol=1e-5)


def run_on_ranks(rank, world_size):
    torch.set_num_threads(1)
    model = make_model()
    out = {}
    for placement, method in (("contiguous", "allreduce"), ("interleaved", "tree")):
        result = ta.generate(model, PROMPT, num_samples=N, **STOPS, placement=placement, method=method,
                             block_size=8, **SAMPLING)
        out[placement] = (result.generated_ids, result.token_logprobs, result.cached_prompt_tokens)
    batch = ta.generate(model, [PROMPT] * N, **STOPS, block_size=8, **SAMPLING)
    out["batch"] = (batch.generated_ids, batch.token_logprobs, batch.cached_prompt_tokens)
    return out


def test_samples_on_two_ranks_equal_the_plain_batch():
    reference = ta.generate(make_model(), [PROMPT] * N, **STOPS, **SAMPLING)
    results = ta.spawn(run_on_ranks, 2, timeout=60)
    for rank in range(2):
        for key in ("contiguous", "interleaved", "batch"):
            ids, logprobs, cached = results[rank][key]
            assert ids == reference.generated_ids, (rank, key)
            for a, b in zip(logprobs, reference.token_logprobs):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
            assert cached == [0] + [32] * (N - 1), (rank, key)  # the prompt prefilled once
            assert results[rank][key] == results[0][key]  # identical on every rank


def test_bad_num_samples():
    model = make_model()
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        ta.generate(model, PROMPT, num_samples=0)
    with pytest.raises(TypeError, match="num_samples must be an int"):
        ta.generate(model, PROMPT, num_samples=2.0)
    with pytest.raises(ValueError, match="samples completions of one prompt, got 2 prompts"):
        ta.generate(model, [PROMPT, PROMPT[:5]], num_samples=2)


# ------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers.llama_checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("bifurcated-cli") / "llama"
    make_checkpoint("llama", directory)
    return directory


def test_cli_num_samples_rank_by_top(checkpoint, tmp_path):
    from typer.testing import CliRunner

    from treeattn.cli import app

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT[:10]))
    common = ["generate", str(checkpoint), "--prompt-ids", str(ids), "--max-new-tokens", "5", "--num-samples", "4",
              "--temperature", "1", "--seed", "7", "--no-stop"]
    runner = CliRunner()
    result = runner.invoke(app, [*common, "--rank-by", "mean-logprob", "--top", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["generated_ids"]) == 4 and report["num_samples"] == 4
    means = report["mean_logprob"]
    assert len(report["ranking"]) == 2
    assert [means[i] for i in report["ranking"]] == sorted(means, reverse=True)[:2]

    text = runner.invoke(app, [*common, "--rank-by", "mean-logprob", "--top", "2"])
    assert text.exit_code == 0, text.output
    lines = text.stdout.strip().splitlines()
    assert len(lines) == 2 and all("(mean logprob " in line for line in lines)
    assert lines[0].startswith(f"[{report['ranking'][0]}] ")

    bad = runner.invoke(app, [*common, "--top", "2"])
    assert bad.exit_code == 2 and "--rank-by mean-logprob" in bad.output
