"""Speculative decoding (treeattn.engine.speculate, generate(speculate="ngram")).

- Prompt lookup proposes the continuation of the longest matching suffix.
- Greedy output with speculation equals transformers' uncached greedy recomputation, on p = 1, 2, 3
  gloo ranks (sub-groups of one spawn), both placements, tree and ring decoding, with drafts both
  accepted and rejected (so the cache roll-back on every rank is exercised).
- Temperature > 0: the token distribution with speculation matches the model's exact distribution
  (chi-square over many seeds on a tiny model).
- Bad input: one-line errors naming the option, before any work.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from conftest import skip_unless_installed  # noqa: E402

skip_unless_installed("transformers", "scipy")  # not imported: the ranks import this module too

from helpers.llama_checkpoints import make_checkpoint  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from treeattn.cli import app  # noqa: E402
from treeattn.engine.config import ConfigError  # noqa: E402
from treeattn.engine.generate import generate  # noqa: E402
from treeattn.models import load_model  # noqa: E402
from treeattn.models.llama import LlamaConfig, random_model  # noqa: E402
from treeattn.parallel import spawn  # noqa: E402
from treeattn.engine.speculate import NgramDrafter  # noqa: E402
from helpers.speculate_sampling import (NEW_TOKENS, PROMPT, _uncached_greedy, SAMPLING_CONFIG, SAMPLING_PROMPT, SAMPLING,  # noqa: E402
                                        exact_distribution, chi_square_pvalue, P_MIN, check_coupled, coupled_tokens,
                                        sampled_counts)

# A prompt with repeats, so that prompt lookup finds matches (some right, some wrong).
BOTH = [("tree", "contiguous"), ("tree", "interleaved"), ("ring", "contiguous"), ("ring", "interleaved")]
# (decode, placement) per arch and number of ranks (one process: plain attention, one case). mistral's
# sliding window (8) is shorter than the prompt, so its verification runs the per-query window path.
CASES = {"llama": {1: BOTH[:1], 2: BOTH, 3: BOTH}, "mistral": {1: BOTH[:1], 2: BOTH[1:2], 3: BOTH[2:3]}}


# ----------------------------------------------------------------------------- drafting


def test_ngram_drafter_proposes_the_continuation_of_the_longest_match():
    drafter = NgramDrafter(max_ngram=3)
    context = torch.tensor([5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 8, 1, 2, 3])
    # suffix [1, 2, 3] occurs at 1..3 (followed by 9, 9, 7); [2, 3] alone also at 7..8 (followed by 4)
    assert drafter.propose(context, 3).tolist() == [9, 9, 7]
    assert drafter.propose(context, 1).tolist() == [9]
    assert drafter.propose(torch.tensor([1, 2, 3, 4]), 4).tolist() == []  # nothing recurs
    assert drafter.propose(torch.tensor([6, 6, 6, 6, 6]), 3).tolist() == [6, 6]  # a repetitive tail: the longest continuation
    assert drafter.propose(context, 0).tolist() == []


# ------------------------------------------------------------------------ end to end, greedy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculate")
    return {arch: (root / arch, make_checkpoint(arch, root / arch)) for arch in ("llama", "mistral")}


def _speculative_cases(rank: int, world_size: int, dirs: dict) -> dict:
    torch.set_num_threads(1)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}
    out = {}
    for arch, directory in dirs.items():
        model = load_model(directory)
        for p, group in groups.items():
            if rank >= p:
                continue
            for decode, placement in CASES[arch][p]:
                result = generate(model, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, decode=decode, placement=placement,
                                  block_size=4, group=group, speculate="ngram", draft_tokens=3)
                out[(arch, p, decode, placement)] = (result.generated_ids[0], result.decode_steps, result.speculation,
                                                    result.token_logprobs[0])
        if rank == 0:
            sampled = generate(model, PROMPT, max_new_tokens=8, temperature=0.8, seed=3, speculate="ngram", draft_tokens=4,
                               group=groups[1])
            out[(arch, "sampled")] = sampled.generated_ids[0]
    if rank < 3:  # temperature > 0 on 3 ranks: every rank returns the same tokens
        result = generate(load_model(dirs["llama"]), PROMPT, max_new_tokens=8, temperature=0.8, seed=3, speculate="ngram",
                          draft_tokens=4, placement="interleaved", block_size=4)
        out[("llama", "sampled", 3)] = result.generated_ids[0]
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints):
    dirs = {arch: str(directory) for arch, (directory, _) in checkpoints.items()}
    return spawn(_speculative_cases, 3, dirs, timeout=300)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_with_speculation_equals_uncached_greedy_on_every_p(ranks, checkpoints, arch):
    expected = _uncached_greedy(checkpoints[arch][1], PROMPT, NEW_TOKENS)
    for p in (1, 2, 3):
        for decode, placement in CASES[arch][p]:
            key = (arch, p, decode, placement)
            results = [r[key] for r in ranks[:p]]
            tokens, steps, spec, logprobs = results[0]
            assert tokens == expected, key
            assert all(r[:3] == results[0][:3] for r in results), f"ranks disagree: {key}"
            assert steps == NEW_TOKENS - 1 - spec["accepted"] and spec["decoded_tokens"] == NEW_TOKENS - 1, key
            assert 0 < spec["accepted"] < spec["drafted"], f"drafts were not both accepted and rejected: {key} {spec}"
            assert spec["tokens_per_forward"] == pytest.approx((NEW_TOKENS - 1) / steps)
            assert all(lp <= 0 for lp in logprobs) and len(logprobs) == NEW_TOKENS


def test_sampling_with_speculation_is_the_same_on_every_rank(ranks):
    assert ranks[0][("llama", "sampled", 3)] == ranks[1][("llama", "sampled", 3)] == ranks[2][("llama", "sampled", 3)]
    assert len(ranks[0][("llama", "sampled", 3)]) == 8


# --------------------------------------------------------------------- end to end, sampling


def test_sampled_tokens_follow_the_model_distribution(one_thread):
    """Temperature 1 with top-k on a vocabulary of 5: over 400 seeds, the first three new tokens with
    speculation are, seed by seed, those decoding without it draws (deterministic given the seeds),
    and follow the exact distribution from uncached forward passes (chi-square at P_MIN)."""
    model = random_model(SAMPLING_CONFIG, seed=2, std=0.5)
    exact = exact_distribution(model, SAMPLING_PROMPT, SAMPLING)
    n = 400
    counts: dict = {}
    found = []
    drafted = accepted = 0
    for seed in range(n):
        result = generate(model, SAMPLING_PROMPT, max_new_tokens=3, ignore_eos=True, seed=seed, speculate="ngram", draft_tokens=2,
                          **SAMPLING)
        key = tuple(result.generated_ids[0])
        counts[key] = counts.get(key, 0) + 1
        found.append(key)
        drafted += result.speculation["drafted"]
        accepted += result.speculation["accepted"]
    assert 0 < accepted < drafted
    check_coupled(found, *coupled_tokens(model, SAMPLING_PROMPT, SAMPLING, range(n)))  # seed by seed: deterministic
    assert chi_square_pvalue(counts, exact, n) > P_MIN


def test_sample_follows_the_exact_distribution():
    """The sampler that decoding, speculation's verification and the seed-by-seed oracle
    (coupled_tokens) all use draws from the exact distribution: 10,000 continuations, chi-square at
    P_MIN (1e-6 false failures over random seeds). Its power there: a temperature 10 % off (1.1 or
    0.9) or top-k 3 or 5 instead of 4 fails with probability > 0.99 (noncentral chi-square, lambda >= 166)."""
    model = random_model(SAMPLING_CONFIG, seed=2, std=0.5)
    n = 10_000
    counts = sampled_counts(model, SAMPLING_PROMPT, SAMPLING, n)
    assert chi_square_pvalue(counts, exact_distribution(model, SAMPLING_PROMPT, SAMPLING), n) > P_MIN


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("options, option, words", [
    (dict(speculate="ngram", draft_tokens=0), "draft_tokens", "[1, 16], got 0"),
    (dict(speculate="ngram", draft_tokens=17), "draft_tokens", "[1, 16]"),
    (dict(speculate="medusa"), "speculate", "'ngram'"),
    (dict(speculate="ngram", num_samples=2), "speculate", "num_samples=2"),
    (dict(speculate="ngram", decode_step="static"), "speculate", "decode_step='static'"),
])
def test_bad_speculation_options_fail_once_naming_the_option(options, option, words):
    model = random_model(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                     num_kv_heads=1, head_dim=8))
    with pytest.raises(ConfigError) as info:
        generate(model, [1, 2], **options)
    assert info.value.option == option and words in str(info.value) and "\n" not in str(info.value)


def test_speculation_with_a_batch_is_refused_before_work():
    model = random_model(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                     num_kv_heads=1, head_dim=8))
    with pytest.raises(ConfigError, match="one prompt at a time, got 2 prompts"):
        generate(model, [[1, 2], [3, 4]], speculate="ngram")


def test_cli_speculation_json_and_errors(checkpoints, tmp_path):
    runner = CliRunner()
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    directory = str(checkpoints["llama"][0])
    base = ["generate", directory, "--prompt-ids", str(ids), "--max-new-tokens", "12", "--no-stop", "--json"]
    plain = json.loads(runner.invoke(app, base).stdout)
    result = runner.invoke(app, base + ["--speculate", "ngram", "--draft-tokens", "3"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    spec = report["speculation"]
    assert report["generated_ids"] == plain["generated_ids"] and "speculation" not in plain
    assert report["timings"]["decode_steps"] == 11 - spec["accepted"] and spec["decoded_tokens"] == 11
    assert set(spec) >= {"drafted", "accepted", "acceptance_rate", "tokens_per_forward"}
    table = runner.invoke(app, base[:-1] + ["--speculate", "ngram", "--draft-tokens", "3"])
    assert table.exit_code == 0 and f"{spec['accepted']}/{spec['drafted']} drafts accepted" in table.stderr
    assert "tokens per forward pass" in table.stderr and "decode forward passes" in table.stderr
    bad = runner.invoke(app, base + ["--speculate", "ngram", "--draft-tokens", "0"])
    assert bad.exit_code == 2 and "--draft-tokens must be an int in [1, 16], got 0" in bad.output
