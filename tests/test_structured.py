"""Structured outputs through the engine (treeattn.engine.structured): JSON schemas, regex, choice, grammar.

A tiny random Llama (a byte-level vocabulary of 262 tokens, tests/gguf_files.py) is forced by the
token mask: every output of 50 JSON schemas of our own (tests/structured_schemas.py), greedy and
sampled, parses and validates against its schema (jsonschema, formats checked) and ends with
finish_reason "stop" at the model's end-of-sequence token. Regexes match whole, choices are one of
the options, a Lark grammar's language holds. Logprobs are the model's own, before the mask. With
prompt-lookup speculation the tokens equal those without. A bad constraint is one line naming it.
All on one rank and on two (where the masks are filled while the step runs and sent to rank 0 after
the plan), and the step's "mask_wait" phase shows rank 0 waited for them at sampling.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("transformers")

from helpers.serve import _write_tiny_llama_gguf  # noqa: E402
from structured_schemas import schemas  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.engine.structured import StructuredOutput  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 2  # the tiny model's <|im_end|>
PROMPTS = ["the cat", "hello there", "a b c", "xyz", "the theme"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("structured") / "tiny.gguf", 0, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def engine(model_file, request):
    """One rank (GroupChannel: the masks are filled in the driver's thread when rank 0 samples) and two
    (spawned ranks: the driver fills them while the ranks run the step, rank 0 reads them when it samples)."""
    with ta.Engine(str(model_file), nproc=request.param, block_size=16, cache_tokens=32768, max_batch_size=64) as engine:
        yield engine


def _run(engine, params: list[ta.SamplingParams], prompts=PROMPTS) -> list[ta.RequestResult]:
    handles = [engine.submit(prompts[i % len(prompts)], p) for i, p in enumerate(params)]
    return [h.result(timeout=600) for h in handles]


def test_fifty_schemas_greedy_and_sampled_all_valid(engine):
    cases = schemas()
    params = [ta.SamplingParams(max_new_tokens=160, temperature=temperature, seed=i, structured=StructuredOutput.json(schema))
              for temperature in (0.0, 1.0) for i, schema in enumerate(cases)]
    results = _run(engine, params)
    for i, result in enumerate(results):
        schema = cases[i % len(cases)]
        assert result.finish_reason == "stop", (i, result.text, result.error)
        assert result.token_ids[-1] == EOS
        value = json.loads(result.text)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    assert len({r.text for r in results}) > 50  # not one output for all


def test_any_json_object_regex_choice_and_grammar(engine):
    regexes = [r"[0-9]{3}-[a-z]{2}", r"(cat|dog)s?", r"[A-Z][a-z]{0,3}\.", r"-?[1-9][0-9]{0,2}"]
    choices = ["yes", "no", "maybe so"]
    lark = 'start: "(" item ("," item){0,2} ")"\nitem: /[ab]/ | NUMBER\nNUMBER: /[0-9]/'
    params = [ta.SamplingParams(max_new_tokens=40, temperature=t, seed=s, structured=StructuredOutput.regex(r))
              for r in regexes for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    params += [ta.SamplingParams(max_new_tokens=40, temperature=1.0, seed=s,
                                 structured=StructuredOutput.choice(choices)) for s in range(6)]
    params += [ta.SamplingParams(max_new_tokens=40, temperature=1.0, seed=s,
                                 structured=StructuredOutput.grammar(lark)) for s in range(4)]
    params += [ta.SamplingParams(max_new_tokens=400, temperature=0.0, structured=StructuredOutput.json())]
    results = _run(engine, params)
    for p, r in zip(params, results):
        assert r.finish_reason == "stop", (p.structured, r.text)
        kind = p.structured.kind
        if kind == "regex":
            assert re.fullmatch(p.structured.value, r.text), (p.structured.value, r.text)
        elif kind == "choice":
            assert r.text in choices
        elif kind == "grammar":
            assert re.fullmatch(r"\(([ab0-9])(,[ab0-9]){0,2}\)", r.text), r.text
        else:
            assert isinstance(json.loads(r.text), dict)
    assert len({r.text for r in results[12:18]}) > 1  # sampled choices differ


def test_logprobs_are_the_models_own_before_the_mask(engine):
    free, constrained = _run(engine, [ta.SamplingParams(max_new_tokens=1, logprobs=5),
                                      ta.SamplingParams(max_new_tokens=8, logprobs=5,
                                                        structured=StructuredOutput.choice(["zz"]))],
                             prompts=["the cat"])
    assert constrained.text == "zz"
    assert constrained.logprobs[0].top == free.logprobs[0].top  # the same distribution at the first position
    # the mask leaves one token at each position: after it every logprob would be 0; before it, the model's own
    assert all(-100 < lp.logprob < -1e-3 for lp in constrained.logprobs[:2])


def test_prompt_lookup_speculation_gives_the_same_tokens(model_file, engine):
    cases = schemas()[:6] + [{"type": "array", "items": {"const": "abcabc"}, "minItems": 3, "maxItems": 3}]
    params = [ta.SamplingParams(max_new_tokens=160, temperature=t, seed=i, structured=StructuredOutput.json(s))
              for t in (0.0, 1.0) for i, s in enumerate(cases)]
    plain = _run(engine, params)
    with ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=8192, max_batch_size=16, speculate="ngram") as spec:
        speculated = _run(spec, params)
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]
    assert all(r.finish_reason == "stop" for r in speculated)
    assert sum(r.speculation["accepted"] for r in speculated) > 0


@pytest.mark.parametrize("build, match", [
    (lambda: StructuredOutput.json({"type": "objekt"}), "the JSON schema is invalid: Invalid type: objekt"),
    (lambda: StructuredOutput.json("{"), "the JSON schema is not JSON"),
    (lambda: StructuredOutput.json([1]), "the JSON schema must be an object, got list"),
    (lambda: StructuredOutput.regex("[0-9"), "the regex is invalid"),
    (lambda: StructuredOutput.choice([]), "choice must be a non-empty list"),
    (lambda: StructuredOutput.grammar("start: foo"), "the grammar is invalid"),
    (lambda: StructuredOutput("xml", "x"), "kind must be one of json, regex, choice, grammar"),
    (lambda: ta.SamplingParams(structured=StructuredOutput.json(), ignore_eos=True), "ignore_eos must be False"),
    (lambda: ta.SamplingParams(structured={"type": "object"}), "structured must be None or a StructuredOutput, got dict"),
])
def test_a_bad_constraint_is_one_line_naming_it(build, match):
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        build()
    assert "\n" not in str(info.value)


def test_rank_zero_waits_for_the_masks_only_at_sampling(engine):
    """The masks come after the plan (StepMasks), read by rank 0 after the step's logits: the
    steps of a constrained request record the "mask_wait" phase, those of a free one do not."""
    engine.rank_measurements(reset=True)
    _run(engine, [ta.SamplingParams(max_new_tokens=8, ignore_eos=True)])
    free = engine.rank_measurements(reset=True)[0].step_phases["decode"]
    _run(engine, [ta.SamplingParams(max_new_tokens=8, structured=StructuredOutput.regex("[a-z]{8}"))])
    constrained = engine.rank_measurements()[0].step_phases["decode"]
    assert free and not any("mask_wait" in phases for phases in free)
    assert constrained and all("mask_wait" in phases for phases in constrained)


def test_a_request_whose_masks_never_came_fails_alone(engine):
    """If the driver's StepMasks leave a marked chunk out, rank 0 samples no unconstrained token for it:
    that request ends with finish_reason "error" naming the missing mask; the free one beside it is served."""
    from treeattn.engine.structured import StepMasks

    grammars = engine._driver.grammars
    grammars.masks = lambda plan: StepMasks({})  # an instance attribute: the driver's next steps call it
    try:
        constrained = ta.SamplingParams(max_new_tokens=8, structured=StructuredOutput.regex("[a-z]{8}"))
        free = ta.SamplingParams(max_new_tokens=8, ignore_eos=True)
        bad, good = _run(engine, [constrained, free])
    finally:
        del grammars.masks
    assert bad.finish_reason == "error" and "no mask came" in bad.error, (bad.finish_reason, bad.error)
    assert good.finish_reason == "length" and len(good.token_ids) == 8


def test_masks_filled_while_the_step_runs_give_the_same_outputs(model_file, monkeypatch):
    """Where a core is free for it (CUDA ranks, CPU cores beyond the ranks' threads: overlap_masks) the
    driver fills the masks after the plan has gone, while the ranks run the step; forced here on 2 ranks,
    the outputs equal those of masks filled before the plan leaves, and validate."""
    from treeattn.engine import transport

    cases = schemas()[:6]
    params = [ta.SamplingParams(max_new_tokens=160, temperature=t, seed=i, structured=StructuredOutput.json(schema))
              for t in (0.0, 1.0) for i, schema in enumerate(cases)]
    results = {}
    for overlap in (False, True):
        monkeypatch.setattr(transport, "overlap_masks", lambda config, overlap=overlap: overlap)
        with ta.Engine(str(model_file), nproc=2, block_size=16, cache_tokens=32768, max_batch_size=64) as engine:
            results[overlap] = _run(engine, params)
    assert [r.token_ids for r in results[True]] == [r.token_ids for r in results[False]]
    for i, result in enumerate(results[True]):
        assert result.finish_reason == "stop", (i, result.text, result.error)
        jsonschema.validate(json.loads(result.text), cases[i % len(cases)])
