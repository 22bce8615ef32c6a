"""lm-evaluation-harness against `treeattn serve` (SmolLM2-135M on 2 ranks) equals lm-eval's `hf` model.

lm-eval's `local-completions` model runs, over a real socket (conftest's session server, shared with
tests/test_readme.py), with nothing but base_url and model
(it finds /tokenizer_info and /tokenize and tokenizes with the server's tokenizer), three small
offline tasks of tests/data/lm_eval (YAML + JSONL, dataset_path: json): multiple choice
(loglikelihood requests: echo + logprobs), perplexity (loglikelihood_rolling) and generation
(generate_until, greedy); `local-chat-completions` runs the generation task through the chat
template. lm-eval's `hf` model runs the same tasks on transformers' load of the same GGUF file
(float32, dequantized). Same accuracy, every request's loglikelihood within 1e-3, the same
generated strings.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from unittest import mock

import pytest

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
TASKS_DIR = Path(__file__).parent / "data" / "lm_eval"
TASKS = ["treeattn_mc", "treeattn_ppl", "treeattn_gen"]
NAME = "smollm2"


@functools.cache
def _task_manager():
    """One index of our three task files for the module's four evaluations. include_defaults=False: lm-eval's
    thousands of built-in task files are not indexed (tens of seconds of CPU each time; no test uses them)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def _evaluate(model, tasks, **kwargs) -> dict:
    """lm_eval.simple_evaluate on our task files, offline; {task: [(doc_id, resps) ...]} and the results."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    here = os.getcwd()
    os.chdir(TASKS_DIR)  # data_files are relative to the task files
    try:
        # add_env_info: torch's collect_env report (pip and nvidia-smi in subprocesses, ~7 s under load), which no test reads
        with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
            out = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=_task_manager(), log_samples=True, **kwargs)
    finally:
        os.chdir(here)
    samples = {task: sorted((s["doc_id"], s["resps"]) for s in rows) for task, rows in out["samples"].items()}
    return {"results": out["results"], "samples": samples}


@pytest.fixture(scope="module")
def served(smollm2_server):
    """lm-eval's runs against conftest's session server (2 ranks, served as "smollm2")."""
    url = f"{smollm2_server.url}/v1"
    completions = _evaluate("local-completions", TASKS, batch_size=4,
                            model_args={"base_url": f"{url}/completions", "model": NAME})
    chat = _evaluate("local-chat-completions", ["treeattn_gen"], apply_chat_template=True,
                     model_args={"base_url": f"{url}/chat/completions", "model": NAME})
    return completions, chat


@pytest.fixture(scope="module")
def reference(smollm2_transformers_dir):
    import torch
    from lm_eval.models.huggingface import HFLM

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_transformers_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_transformers_dir)  # the GGUF file's, saved there
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")
    return _evaluate(lm, TASKS), _evaluate(lm, ["treeattn_gen"], apply_chat_template=True)


def _loglikelihoods(samples) -> list[float]:
    """Every request's loglikelihood: a loglikelihood request's response is (ll, is_greedy), a rolling one's ll."""
    values = [resp[0] for _, resps in samples for resp in resps]
    return [float(v[0] if isinstance(v, (list, tuple)) else v) for v in values]


def test_multiple_choice_same_accuracy_and_loglikelihoods(served, reference):
    (ours, _), (theirs, _) = served, reference
    assert ours["results"]["treeattn_mc"]["acc,none"] == theirs["results"]["treeattn_mc"]["acc,none"]
    got, want = _loglikelihoods(ours["samples"]["treeattn_mc"]), _loglikelihoods(theirs["samples"]["treeattn_mc"])
    assert len(got) == len(want) == 16
    assert got == pytest.approx(want, abs=1e-3)


def test_perplexity_same_loglikelihoods(served, reference):
    (ours, _), (theirs, _) = served, reference
    got, want = _loglikelihoods(ours["samples"]["treeattn_ppl"]), _loglikelihoods(theirs["samples"]["treeattn_ppl"])
    assert len(got) == len(want) == 2
    assert got == pytest.approx(want, abs=1e-3)
    word = "word_perplexity,none"
    assert ours["results"]["treeattn_ppl"][word] == pytest.approx(theirs["results"]["treeattn_ppl"][word], rel=1e-4)


def test_generation_same_strings(served, reference):
    (ours, ours_chat), (theirs, theirs_chat) = served, reference
    generated = ours["samples"]["treeattn_gen"]
    assert generated == theirs["samples"]["treeattn_gen"]
    assert any(resps[0][0].strip() for _, resps in generated)  # not all empty
    assert ours_chat["samples"]["treeattn_gen"] == theirs_chat["samples"]["treeattn_gen"]
