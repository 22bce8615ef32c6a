"""Speculative decoding with a draft model (generate(speculate="draft", draft_model=...), treeattn.engine.draft_model).

- Greedy output with a draft model equals greedy output without speculation and transformers'
  uncached greedy recomputation, on p = 1, 2, 3 gloo ranks (sub-groups of one spawn), both
  placements, tree and ring decoding, ring and split prefill; with the model itself as draft (every
  draft accepted) and another random model (drafts rejected), both given as checkpoint paths (what
  travels to ranks). The draft runs in the engine on every rank (its cache's layout, rollback and
  prefix sharing: tests/test_engine_draft.py).
- Temperature > 0 with a draft model: the tokens follow the model's exact distribution (chi-square
  over many seeds on a tiny model).
- Bad input: one-line errors naming the option, before any work (and, for the CLI, before spawning).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers", "scipy")  # not imported: the ranks import this module too

from helpers.llama_checkpoints import VOCAB, make_checkpoint  # noqa: E402
from helpers.speculate_sampling import (PROMPT, SAMPLING, SAMPLING_CONFIG, SAMPLING_PROMPT, _uncached_greedy, chi_square_pvalue,  # noqa: E402
                                        exact_distribution, P_MIN, check_coupled, coupled_tokens)
from typer.testing import CliRunner  # noqa: E402

from treeattn.cli import app  # noqa: E402
from treeattn.engine.config import ConfigError, EngineConfig  # noqa: E402
from treeattn.engine.generate import generate  # noqa: E402
from treeattn.models import load_model  # noqa: E402
from treeattn.models.llama import LlamaConfig, random_model  # noqa: E402
from treeattn.parallel import spawn  # noqa: E402
from helpers.llama_checkpoints import _save_tokenizer  # noqa: E402

NEW_TOKENS = 12
BOTH = [("tree", "contiguous"), ("tree", "interleaved"), ("ring", "contiguous"), ("ring", "interleaved")]
CASES = {1: BOTH[:1], 2: BOTH, 3: BOTH}


# ------------------------------------------------------------------------ end to end, greedy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The model, and another random model of the same vocabulary (the draft that gets rejected)."""
    root = tmp_path_factory.mktemp("speculate_draft")
    return {name: (root / name, make_checkpoint("llama", root / name, seed=seed)) for name, seed in (("model", 0), ("other", 1))}


def _draft_cases(rank: int, world_size: int, dirs: dict) -> dict:
    torch.set_num_threads(1)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    model = load_model(dirs["model"])
    out = {}
    for p, group in groups.items():
        if rank >= p:
            continue
        for decode, placement in CASES[p]:
            for draft in ("model", "other"):
                prefill = "split" if (p, decode, placement, draft) == (3, "tree", "interleaved", "other") else "auto"
                result = generate(model, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, decode=decode, placement=placement,
                                  prefill=prefill, block_size=4, group=group, speculate="draft", draft_model=dirs[draft],
                                  draft_tokens=3)
                out[(p, decode, placement, draft)] = (result.generated_ids[0], result.decode_steps, result.speculation)
    # temperature > 0 on 3 ranks: every rank returns the same tokens
    result = generate(model, PROMPT, max_new_tokens=8, temperature=0.8, seed=3, speculate="draft", draft_model=dirs["other"],
                      draft_tokens=4, placement="interleaved", block_size=4)
    out["sampled"] = result.generated_ids[0]
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints):
    return spawn(_draft_cases, 3, {name: str(directory) for name, (directory, _) in checkpoints.items()}, timeout=300)


def test_greedy_with_a_draft_model_equals_uncached_greedy_on_every_p(ranks, checkpoints):
    expected = _uncached_greedy(checkpoints["model"][1], PROMPT, NEW_TOKENS)
    plain = generate(load_model(checkpoints["model"][0]), PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert plain.generated_ids[0] == expected
    for p in (1, 2, 3):
        for decode, placement in CASES[p]:
            for draft in ("model", "other"):
                key = (p, decode, placement, draft)
                results = [r[key] for r in ranks[:p]]
                tokens, steps, spec = results[0]
                assert tokens == expected, key
                assert all(r[0] == tokens and r[1] == steps for r in results), f"ranks disagree: {key}"
                assert all(r[2] == spec for r in results), f"ranks report different speculation: {key}"
                assert steps == NEW_TOKENS - 1 - spec["accepted"] and spec["decoded_tokens"] == NEW_TOKENS - 1, key
                assert spec["draft_model"].endswith(draft), key
                if draft == "model":  # the model drafting for itself: every draft accepted, k + 1 tokens per forward
                    assert spec["accepted"] == spec["drafted"] > 0 and spec["tokens_per_forward"] > 3, (key, spec)
                else:
                    assert spec["accepted"] < spec["drafted"] / 2, (key, spec)


def test_sampling_with_a_draft_model_is_the_same_on_every_rank(ranks):
    assert ranks[0]["sampled"] == ranks[1]["sampled"] == ranks[2]["sampled"] and len(ranks[0]["sampled"]) == 8


# --------------------------------------------------------------------- end to end, sampling


def test_sampled_tokens_with_a_draft_model_follow_the_model_distribution(one_thread):
    """Temperature 1 with top-k 4 of 5 tokens, a different random model as draft (its argmax proposals
    are accepted and rejected): over 400 seeds the first three new tokens are, seed by seed, those
    decoding without speculation draws (deterministic given the seeds), and follow the model's exact
    distribution (chi-square at P_MIN)."""
    model = random_model(SAMPLING_CONFIG, seed=2, std=0.5)
    draft = random_model(SAMPLING_CONFIG, seed=5, std=0.5)
    exact = exact_distribution(model, SAMPLING_PROMPT, SAMPLING)
    n = 400
    counts: dict = {}
    found = []
    drafted = accepted = 0
    for seed in range(n):
        result = generate(model, SAMPLING_PROMPT, max_new_tokens=3, ignore_eos=True, seed=seed, speculate="draft",
                          draft_model=draft,
                          draft_tokens=2, **SAMPLING)
        key = tuple(result.generated_ids[0])
        counts[key] = counts.get(key, 0) + 1
        found.append(key)
        drafted += result.speculation["drafted"]
        accepted += result.speculation["accepted"]
    assert 0 < accepted < drafted
    check_coupled(found, *coupled_tokens(model, SAMPLING_PROMPT, SAMPLING, range(n)))  # seed by seed: deterministic
    assert chi_square_pvalue(counts, exact, n) > P_MIN


# ---------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """Checkpoints with tokenizers: the model, a draft with the same tokenizer, one with two ids swapped,
    one with a token marked special, one with a 16-position context window, and one with another vocabulary size."""
    root = tmp_path_factory.mktemp("tokenized")
    dirs = {}
    for name, options in (("model", {}), ("same", {}), ("swapped", dict(swap=True)), ("special", dict(special=("t5",)))):
        dirs[name] = root / name
        make_checkpoint("llama", dirs[name])
        _save_tokenizer(dirs[name], **options)
    dirs["short"] = root / "short"
    make_checkpoint("llama", dirs["short"])
    _save_tokenizer(dirs["short"])
    config = json.loads((dirs["short"] / "config.json").read_text())
    (dirs["short"] / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=16)))
    dirs["not_a_model"] = root / "not_a_model"
    dirs["not_a_model"].mkdir()
    (dirs["not_a_model"] / "config.json").write_text("{}")
    return dirs


def test_draft_model_and_speculate_draft_need_each_other():
    for options, option, words in [
        (dict(draft_model="d.gguf"), "draft_model", "got no speculation"),
        (dict(speculate="ngram", draft_model="d.gguf"), "draft_model", "got speculate='ngram'"),
        (dict(speculate="draft"), "speculate", "needs draft_model=PATH"),
        (dict(speculate="draft", draft_model=3), "draft_model", "checkpoint path or a loaded model, got int"),
        (dict(speculate="draft", draft_model="d.gguf", draft_tokens=0), "draft_tokens", "[1, 16], got 0"),
        (dict(speculate="draft", draft_model="d.gguf", draft_tokens=17), "draft_tokens", "[1, 16]"),
    ]:
        with pytest.raises(ConfigError) as info:
            EngineConfig(**options)
        assert info.value.option == option and words in str(info.value) and "\n" not in str(info.value), options


@pytest.mark.parametrize("draft, words", [
    ("swapped", "another tokenizer than the model: token 't1' is id 2 in the draft, 1 in the model"),
    ("special", "another tokenizer than the model: added token"),
    ("short", "context window of 16 positions is shorter than the 20"),
    ("missing", "is not a usable model checkpoint"),
    ("not_a_model", "is not a usable model checkpoint"),
])
def test_a_draft_model_that_does_not_fit_is_refused_before_work(tokenized, draft, words):
    model = load_model(tokenized["model"])
    path = tokenized.get(draft, tokenized["model"].parent / "missing")
    with pytest.raises(ConfigError) as info:
        generate(model, [1, 2, 3, 4], max_new_tokens=16, speculate="draft", draft_model=path)
    assert info.value.option == "draft_model" and words in str(info.value) and "\n" not in str(info.value)


def test_a_draft_model_of_another_vocabulary_or_without_tokenizer_is_refused(tokenized):
    model = load_model(tokenized["model"])
    small = random_model(LlamaConfig(vocab_size=VOCAB // 2, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                     num_kv_heads=1, head_dim=8))
    with pytest.raises(ConfigError, match=f"vocabulary of {VOCAB // 2} tokens, the model {VOCAB}"):
        generate(model, [1, 2, 3], speculate="draft", draft_model=small)
    untokenized = random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                           num_kv_heads=1, head_dim=8))
    with pytest.raises(ConfigError, match="draft_model has no tokenizer"):
        generate(model, [1, 2, 3], speculate="draft", draft_model=untokenized)
    same = generate(model, [1, 2, 3], max_new_tokens=4, speculate="draft", draft_model=tokenized["same"])
    assert same.speculation["draft_model"] == str(tokenized["same"])


def test_cli_draft_model_json_and_errors(tokenized, tmp_path):
    runner = CliRunner()
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    base = ["generate", str(tokenized["model"]), "--prompt-ids", str(ids), "--max-new-tokens", "12", "--no-stop", "--json"]
    plain = json.loads(runner.invoke(app, base).stdout)
    result = runner.invoke(app, base + ["--speculate", "draft", "--draft-model", str(tokenized["same"]), "--draft-tokens", "3"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    spec = report["speculation"]
    assert report["generated_ids"] == plain["generated_ids"]
    assert report["timings"]["decode_steps"] == 11 - spec["accepted"] and spec["decoded_tokens"] == 11
    assert spec["draft_model"] == str(tokenized["same"])
    assert set(spec) >= {"drafted", "accepted", "acceptance_rate", "tokens_per_forward"}
    for extra, words in [
        (["--draft-model", str(tokenized["same"])], "--draft-model is the drafter of --speculate draft, got no speculation"),
        (["--speculate", "draft"], "--speculate draft needs --draft-model PATH"),
        (["--speculate", "draft", "--draft-model", str(tokenized["swapped"])], "--draft-model has another tokenizer"),
        (["--speculate", "draft", "--draft-model", str(tokenized["short"])], "--draft-model's context window of 16 positions"),
        (["--speculate", "draft", "--draft-model", str(tmp_path / "nothing")], f"--draft-model {tmp_path / 'nothing'} is not"),
        (["--speculate", "draft", "--draft-model", str(tokenized["same"]), "--draft-tokens", "17"],
         "--draft-tokens must be an int in [1, 16]"),
    ]:
        bad = runner.invoke(app, base + extra + ["--nproc", "2"])  # refused before the ranks are spawned (exit 2, not 1)
        lines = bad.output.strip().splitlines()
        assert bad.exit_code == 2 and len(lines) == 1 and words in lines[0], (extra, bad.output)


def test_the_memory_check_counts_the_draft_on_every_rank(tokenized, monkeypatch):
    """treeattn generate's check before spawning: the draft model and its share of the cache count
    once per rank, and a draft that does not fit is named."""
    from pathlib import Path

    from treeattn.commands import generate as engine_cli
    from treeattn.engine import memory
    from treeattn.engine.generate import batch_config
    from treeattn.engine.memory import kv_cache_bytes_per_rank, model_bytes
    from treeattn.engine.request import SamplingParams
    from treeattn.models.loader import read_config

    model, prompts = str(tokenized["model"]), [list(range(8))]
    model_config, weights = read_config(model), model_bytes(model, torch.float32)
    config, sampling = EngineConfig(speculate="draft", draft_model=model), SamplingParams(max_new_tokens=8)
    kv = kv_cache_bytes_per_rank(batch_config(config, sampling, 1, prompts, 2), model_config, torch.float32)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 4 * (weights + kv))
    engine_cli._check_before_spawning(config, sampling, 1, Path(model), prompts, 2, "float32")  # fits: 2 ranks x (model + draft)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 4 * (weights + kv) - 1)
    with pytest.raises(ValueError, match=r"^draft_model: 2 rank\(s\) x \(.* of draft model and its cache\) = "):
        engine_cli._check_before_spawning(config, sampling, 1, Path(model), prompts, 2, "float32")
