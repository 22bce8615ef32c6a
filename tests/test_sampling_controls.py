"""presence_penalty, frequency_penalty, repetition_penalty, min_p and logit_bias (SamplingParams).

The sampler (treeattn.engine.worker.sampling) is checked against a float64 reference written here from
vLLM's semantics in plain Python: logit_bias added by token id; repetition over the prompt's and the
output's tokens (positive logits divided, negative multiplied); frequency (count in the output) and
presence (once per token in the output) subtracted; greedy is the argmax of that; sampling divides
by the temperature, drops tokens whose probability is below min_p times the top one, then top-k,
then top-p. The engine's greedy tokens under penalties equal a decode loop over transformers'
float64 logits with the reference applied; with prompt-lookup speculation (one rank and two) the
tokens, greedy and sampled, equal those without it. Bad values are one line naming the field.
"""

from __future__ import annotations

import doctest
import math
from collections import Counter

import pytest
import torch

import treeattn as ta
from treeattn.engine.worker import sampling as sampling_module
from treeattn.engine.worker.sampling import adjust_logits, sample, sampling_probs


def reference_adjust(logits: list[float], params: ta.SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    out = [float(x) for x in logits]
    for token, bias in params.logit_bias:
        out[token] += bias
    counts, seen = Counter(output), set(prompt) | set(output)
    for t in range(len(out)):
        if params.repetition_penalty != 1 and t in seen:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        out[t] -= params.frequency_penalty * counts[t] + params.presence_penalty * (counts[t] > 0)
    return out


def reference_probs(logits: list[float], params: ta.SamplingParams) -> list[float]:
    scaled = [x / params.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    keep = [True] * len(weights)
    if params.min_p > 0:
        keep = [w / total >= params.min_p * (1 / total) for w in weights]  # the top token's probability is 1 / total
    if 0 < params.top_k < len(weights):
        kth = sorted((s for s, k in zip(scaled, keep) if k), reverse=True)[min(params.top_k, sum(keep)) - 1]
        keep = [k and s >= kth for s, k in zip(scaled, keep)]
    if params.top_p < 1:
        kept_total = sum(w for w, k in zip(weights, keep) if k)
        order = sorted((i for i in range(len(weights)) if keep[i]), key=lambda i: -scaled[i])
        before = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and before >= params.top_p:
                keep[i] = False
            before += weights[i] / kept_total
    kept_total = sum(w for w, k in zip(weights, keep) if k)
    return [w / kept_total if k else 0.0 for w, k in zip(weights, keep)]


def _cases(count: int):
    g = torch.Generator().manual_seed(7)
    for case in range(count):
        vocab = int(torch.randint(2, 40, (1,), generator=g))
        logits = (torch.randn(vocab, generator=g, dtype=torch.float64) * 3).float()
        prompt = torch.randint(0, vocab, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        u = torch.rand(8, generator=g, dtype=torch.float64).tolist()
        bias = {int(t): round(200 * u[0] - 100, 3) for t in torch.randint(0, vocab, (case % 3,), generator=g).tolist()}
        params = ta.SamplingParams(temperature=0.2 + 2 * u[1], presence_penalty=4 * u[2] - 2, frequency_penalty=4 * u[3] - 2,
                                   repetition_penalty=[1.0, 0.5 + 2 * u[4], 1.3][case % 3], min_p=[0.0, u[5] / 2, 0.2][case % 3],
                                   top_k=[0, 3, vocab][case % 3], top_p=[1.0, 0.5 + u[6] / 2, 0.9][(case // 3) % 3],
                                   logit_bias=bias)
        yield logits, params, prompt, output


def test_adjusted_logits_and_distribution_equal_the_float64_reference():
    for logits, params, prompt, output in _cases(300):
        adjusted = adjust_logits(logits[None], params, prompt, output)[0]
        expected = reference_adjust(logits.tolist(), params, prompt, output)
        assert adjusted.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        probs = sampling_probs(adjusted[None], params)[0]
        assert probs.tolist() == pytest.approx(reference_probs(expected, params), rel=1e-9, abs=1e-12)
        greedy = ta.SamplingParams(**{**_fields(params), "temperature": 0.0})
        token = int(sample(logits[None], greedy, torch.Generator(), prompt_ids=prompt, output_ids=output)[0])
        assert expected[token] == max(expected)


@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
def test_a_large_vocabulary_keeps_the_reference_tokens_and_draws_its_inverse_cdf(shape):
    """Vocabularies of 3,000-40,000 logits, where top-p looks at the most likely tokens first and widens
    (kept_distribution): the same kept tokens as the reference's full stable sort, ties at every edge included,
    the same probabilities, and sample()'s token is the reference distribution's inverse CDF at the same draw."""
    g = torch.Generator().manual_seed({"peaked": 1, "flat": 2, "ties": 3}[shape])
    for case in range(6):
        vocab = int(torch.randint(3000, 40000, (1,), generator=g))
        logits = torch.randn(vocab, generator=g, dtype=torch.float64) * (0.3 if shape == "flat" else 2)
        if shape == "peaked":
            logits[torch.randint(0, vocab, (30,), generator=g)] += 12
        if shape == "ties":  # a few distinct values: ties at the top-p and top-k edges
            logits = torch.round(logits * 2) / 2
        logits = logits.float()
        params = ta.SamplingParams(temperature=[0.7, 1.0, 1.5][case % 3], top_p=[0.9, 0.3, 0.999][case % 3],
                                   top_k=[0, 700, 0][case % 3], min_p=[0.0, 0.0, 0.01][case % 3])
        expected = reference_probs(logits.double().tolist(), params)
        probs = sampling_probs(logits[None], params)[0]
        assert [p > 0 for p in probs.tolist()] == [p > 0 for p in expected]
        assert probs.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-15)
        generator = torch.Generator().manual_seed(case)
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(case), dtype=torch.float64))
        cdf = torch.tensor(expected, dtype=torch.float64).cumsum(dim=0)
        want = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
        assert int(sample(logits[None], params, generator)[0]) == want


def _fields(params: ta.SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_greedy_follows_the_bias_and_penalties():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    g = torch.Generator()
    assert int(sample(logits, ta.SamplingParams(), g)[0]) == 0
    assert int(sample(logits, ta.SamplingParams(logit_bias={2: 5.0}), g)[0]) == 2
    assert int(sample(logits, ta.SamplingParams(repetition_penalty=1.1), g, prompt_ids=[0])[0]) == 1  # 3 / 1.1 < 2.9
    assert int(sample(logits, ta.SamplingParams(repetition_penalty=1.1), g, output_ids=[1])[0]) == 0
    assert int(sample(logits, ta.SamplingParams(presence_penalty=0.2), g, prompt_ids=[0])[0]) == 0  # the prompt does not count
    assert int(sample(logits, ta.SamplingParams(presence_penalty=0.2), g, output_ids=[0])[0]) == 1
    assert int(sample(logits, ta.SamplingParams(frequency_penalty=0.06), g, output_ids=[0, 0])[0]) == 1  # 3 - 0.12 < 2.9
    assert int(sample(logits, ta.SamplingParams(frequency_penalty=0.06), g, output_ids=[0])[0]) == 0


def test_min_p_one_keeps_only_the_top_token():
    logits = torch.tensor([[1.0, 4.0, 3.999, -2.0]])
    probs = sampling_probs(logits, ta.SamplingParams(temperature=1.0, min_p=1.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_the_sampling_module_examples_run():
    assert doctest.testmod(sampling_module, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2] (0: none), got 2.5"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be a number in [-2, 2] (0: none), got nan"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0 (1: none), got 0"),
    ("repetition_penalty", "2", "repetition_penalty must be a finite number > 0 (1: none), got '2'"),
    ("min_p", 1.5, "min_p must be a number in [0, 1] (0: none), got 1.5"),
    ("logit_bias", {3: -100.5}, "logit_bias: the bias of token 3 must be a number in [-100, 100], got -100.5"),
    ("logit_bias", {-1: 1}, "logit_bias: token ids must be ints >= 0, got -1"),
    ("logit_bias", {"5": 1}, "logit_bias: token ids must be ints >= 0, got '5'"),
    ("logit_bias", [(1, 1), (1, 2)], "logit_bias: token 1 is given twice"),
    ("logit_bias", "x", "logit_bias must be a mapping of token ids to biases, got 'x'"),
])
def test_bad_values_are_one_line_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as info:
        ta.SamplingParams(**{field: value})
    assert str(info.value) == message


# ---------------------------------------------------------------- the engine

PENALIZED = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={5: 1.5, 9: -3.0})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers.llama_checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("controls") / "llama"
    hf = make_checkpoint("llama", directory)
    return directory, hf.double().eval()


def _reference_greedy(hf, prompt: list[int], new_tokens: int, params: ta.SamplingParams) -> list[int]:
    """Greedy decoding over transformers' float64 logits (uncached forward) with the reference's penalties,
    after checking that no near-tie could flip a token."""
    output: list[int] = []
    for _ in range(new_tokens):
        with torch.no_grad():
            row = hf(torch.tensor([prompt + output])).logits[0, -1].tolist()
        adjusted = reference_adjust(row, params, prompt, output)
        first, second = sorted(adjusted, reverse=True)[:2]
        assert first - second > 1e-3, "a near-tie: pick another prompt"
        output.append(adjusted.index(first))
    return output


def test_engine_greedy_with_penalties_equals_the_reference(checkpoint):
    from helpers.llama_checkpoints import VOCAB

    directory, hf = checkpoint
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    params = ta.SamplingParams(max_new_tokens=12, ignore_eos=True, **PENALIZED)
    with ta.Engine(str(directory), nproc=1, block_size=4, cache_tokens=256) as engine:
        penalized, = engine.generate(prompt, params)
        plain, = engine.generate(prompt, max_new_tokens=12, ignore_eos=True)
        with pytest.raises(ValueError, match=r"^logit_bias: token id 128 is outside the vocabulary \[0, 128\)$"):
            engine.submit(prompt, ta.SamplingParams(logit_bias={128: 1.0}))
    assert penalized.token_ids == _reference_greedy(hf, prompt, 12, params)
    assert penalized.token_ids != plain.token_ids  # the penalties changed the answer


@pytest.mark.parametrize("nproc", [1, 2])
def test_speculation_gives_the_tokens_decoding_gives(checkpoint, nproc):
    """Prompt lookup drafts from a repeating prompt; every verified position counts the drafts kept
    before it as output, so the tokens (greedy and sampled, same seed) are those without speculation."""
    directory, _ = checkpoint
    phrase = [7, 3, 11, 42, 5, 9]
    prompt = phrase * 4
    requests = [ta.SamplingParams(max_new_tokens=10, ignore_eos=True, **PENALIZED),
                ta.SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=5, min_p=0.05, **PENALIZED),
                # < 1 favours repeats: drafts accepted
                ta.SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=0.7)]
    outcomes = {}
    for speculate in (None, "ngram"):
        with ta.Engine(str(directory), nproc=nproc, block_size=4, cache_tokens=256, speculate=speculate, threads_per_rank=1,
                       prefix_cache=False) as engine:
            outcomes[speculate] = [engine.generate(prompt, p)[0] for p in requests]
    assert [r.token_ids for r in outcomes["ngram"]] == [r.token_ids for r in outcomes[None]]
    assert sum(r.speculation["accepted"] for r in outcomes["ngram"]) > 0  # drafts were kept, and penalized positions after them
