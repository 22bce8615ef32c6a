"""ta.Engine from Python under hostile use (issue 24): seeds beyond a generator's range, calls
after close or failure, callbacks that raise BaseExceptions, stop strings that span tokens, tiny
temperatures and top_p, Ctrl-C during generate. A real engine over the tiny GGUF model of
test_serve.py (byte-level tokenizer), one in-process rank, except for the Ctrl-C test (2 ranks in a
child process that sends SIGINT to its own process group, as a terminal's Ctrl-C does).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.processes import default_signals  # noqa: E402
from helpers.serve import _write_tiny_llama_gguf  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.engine import EngineError, SamplingParams  # noqa: E402
from treeattn.models.llama import LlamaConfig, random_model  # noqa: E402

PROMPT = "the cat"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("engine_hostile") / "tiny.gguf", 0, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def engine(model_file):
    with ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=2048, max_batch_size=8) as engine:
        yield engine


def _call_with_backstop(fn, seconds: float = 120.0):
    """fn() in a thread; a hang (the bug) fails the test instead of hanging it."""
    box: list = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001
            box.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"{fn} did not return within {seconds} s"
    return box[0]


# ------------------------------------------------------------------------- 1: seeds


def test_a_seed_beyond_2_64_is_refused_by_sampling_params_and_the_engine_lives(engine):
    for seed in (2**64, 2**70, -1):
        with pytest.raises(ValueError, match=r"^seed must be an int >= 0 and below 2\*\*64"):
            SamplingParams(seed=seed)
    with pytest.raises(ValueError, match=r"^seed"):
        engine.generate([PROMPT], max_new_tokens=2, seed=2**64)
    assert engine.healthy
    result = engine.generate([PROMPT], max_new_tokens=3, temperature=1.0, seed=2**64 - 1)[0]
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def test_an_exception_while_sampling_one_request_fails_that_request_alone(engine, monkeypatch):
    """Sampling runs on rank 0 after the step's last collective: a request whose sampling raises
    (here: a seed that a patched sampler refuses) finishes with "error" naming the exception, the
    requests batched with it finish normally, and the engine serves on."""
    from treeattn.engine.worker import sampling

    real = sampling.sample

    def sample(logits, spec, generator, **history):
        if spec.seed == 666:
            raise ArithmeticError("this request's sampler is broken")
        return real(logits, spec, generator, **history)

    monkeypatch.setattr(sampling, "sample", sample)
    bad = engine.submit(PROMPT, SamplingParams(max_new_tokens=20, temperature=1.0, seed=666, logprobs=2))
    good = engine.submit(PROMPT, SamplingParams(max_new_tokens=20, temperature=1.0, seed=1))
    result = bad.result(timeout=60)
    assert result.finish_reason == "error" and "ArithmeticError: this request's sampler is broken" in result.error
    assert result.token_ids == [] and result.text == ""
    assert good.result(timeout=60).finish_reason == "length" and len(good.result().token_ids) == 20
    assert engine.healthy and engine.stats()["running"] == 0
    assert engine.generate([PROMPT], max_new_tokens=2)[0].finish_reason == "length"


POISON = 99  # a token id that makes the embedding below raise


class PoisonedEmbedding(torch.nn.Embedding):
    """An embedding that raises when it meets POISON: a step that fails inside the forward pass
    on the ranks (defined at module level so that the spawned ranks can unpickle it)."""

    def forward(self, tokens):
        if bool((tokens == POISON).any()):
            raise ArithmeticError("a poisoned token reached the embedding")
        return super().forward(tokens)


def test_a_step_that_raises_on_the_ranks_fails_its_requests_and_the_ranks_restart():
    """Two spawned ranks: the step holding the poisoned prompt raises in the forward pass; that
    request fails naming the exception (no traceback), the ranks are restarted, the request queued
    behind it gets the tokens it gets on a healthy engine, and the engine serves on."""
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, max_position_embeddings=256)
    model = random_model(config, seed=1, std=0.15)
    poisoned = PoisonedEmbedding(config.vocab_size, config.hidden_size)
    poisoned.load_state_dict(model.embed_tokens.state_dict())
    model.embed_tokens = poisoned
    good = [5, 6, 7, 8, 9]
    with ta.Engine(model, nproc=2, block_size=4, cache_tokens=256, max_batch_size=1, timeout_s=30, threads_per_rank=1) as engine:
        reference = engine.generate([good], max_new_tokens=8)[0].token_ids
        assert POISON not in reference
        bad = engine.submit([5, POISON, 7], SamplingParams(max_new_tokens=4))
        queued = engine.submit(good, SamplingParams(max_new_tokens=8))
        result = bad.result(timeout=300)
        assert result.finish_reason == "error" and "ArithmeticError: a poisoned token" in result.error
        assert "restarted its ranks" in result.error and "Traceback" not in result.error
        assert queued.result(timeout=300).token_ids == reference
        assert engine.healthy and engine.stats()["rank_restarts"] == 1
        assert engine.generate([good], max_new_tokens=8)[0].token_ids == reference
    assert not multiprocessing.active_children()


# ------------------------------------------------------------------------- 6: tiny temperature, tiny top_p


@pytest.mark.parametrize("sampling", [dict(temperature=1e-40), dict(temperature=5e-324), dict(temperature=1.0, top_p=1e-50),
                                      dict(temperature=1e-30, top_k=5, top_p=1e-40)])
def test_a_tiny_temperature_or_top_p_answers_as_greedy(engine, sampling):
    greedy = engine.generate([PROMPT], max_new_tokens=16, temperature=0.0)[0]
    got = engine.generate([PROMPT], max_new_tokens=16, seed=7, **sampling)[0]
    assert got.token_ids == greedy.token_ids


# ------------------------------------------------------------------------- 3: callbacks


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, GeneratorExit, RuntimeError])
def test_a_callback_that_raises_fails_its_request_alone(engine, raised):
    calls = []

    def callback(event):
        calls.append(event)
        raise raised("from the callback")

    bad = engine.submit(PROMPT, SamplingParams(max_new_tokens=20), on_event=callback)
    good = engine.submit(PROMPT, SamplingParams(max_new_tokens=20))
    result = bad.result(timeout=60)
    assert good.result(timeout=60).finish_reason == "length" and len(good.result().token_ids) == 20
    if issubclass(raised, Exception):  # an Exception is logged and the request goes on
        assert result.finish_reason == "length" and len(calls) == 20
    else:
        assert result.finish_reason == "error" and raised.__name__ in result.error and len(calls) == 1
    assert engine.healthy
    assert engine.generate([PROMPT], max_new_tokens=2)[0].finish_reason == "length"


# ------------------------------------------------------------------------- 5: stop strings


def _stop_inside(text: str, length: int) -> tuple[str, int]:
    """A stop string of `length` characters of `text` (no U+FFFD, the decoding of a byte that is no
    character alone) where it first occurs, after the first character: (stop, where)."""
    for k in range(1, len(text) - length):
        stop = text[k : k + length]
        if "\ufffd" not in stop and text.find(stop) == k:
            return stop, k
    raise AssertionError(f"no stop string of {length} characters in {text!r}")


@pytest.mark.parametrize("length", [2, 3, 5])
def test_stop_strings_spanning_tokens_end_the_text_right_before_them_everywhere(engine, length):
    full = engine.generate([PROMPT], max_new_tokens=60, temperature=0.0)[0]
    stop, where = _stop_inside(full.text, length)
    assert len(stop.encode()) >= 2  # byte-level tokens: it spans >= 2 tokens
    expected = full.text[:where]
    result = engine.generate([PROMPT], max_new_tokens=60, temperature=0.0, stop=[stop])[0]
    assert (result.text, result.finish_reason) == (expected, "stop")
    events = list(engine.stream(PROMPT, max_new_tokens=60, temperature=0.0, stop=[stop]))
    assert "".join(e.text for e in events) == expected and events[-1].finish_reason == "stop"
    never = stop[0] + "\u2603"  # its first character appears (held back), the rest never comes
    events = list(engine.stream(PROMPT, max_new_tokens=60, temperature=0.0, stop=[never]))
    assert "".join(e.text for e in events) == full.text and events[-1].finish_reason == "length"
    assert engine.generate([PROMPT], max_new_tokens=60, temperature=0.0, stop=[never])[0].text == full.text


# ------------------------------------------------------------------------- 2: after close or failure


def test_calls_after_a_failure_or_close_raise_engine_error_and_never_hang(model_file):
    engine = ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=1024)

    def broken_step(plan):
        raise RuntimeError("injected step failure")

    engine._channel.run = broken_step  # the next step fails: the engine is failed for good
    assert engine.submit(PROMPT, SamplingParams(max_new_tokens=2)).result(timeout=60).finish_reason == "error"
    for call in (engine.clear_prefix_cache, engine.rank_measurements, lambda: engine.submit(PROMPT)):
        kind, value = _call_with_backstop(call)
        assert kind == "raised" and isinstance(value, EngineError), value
    engine.close()
    for call in (engine.clear_prefix_cache, engine.rank_measurements, lambda: engine.generate([PROMPT])):
        kind, value = _call_with_backstop(call)
        assert kind == "raised" and isinstance(value, EngineError), value


def test_clear_prefix_cache_after_close_raises(model_file):
    engine = ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=1024)
    engine.clear_prefix_cache()  # works while open
    engine.close()
    kind, value = _call_with_backstop(engine.clear_prefix_cache)
    assert kind == "raised" and isinstance(value, EngineError) and "closed" in str(value)


# ------------------------------------------------------------------------- 11: Ctrl-C


CTRL_C = """
import os, signal, sys, threading, time
import treeattn as ta


def main():
    engine = ta.Engine(sys.argv[1], nproc=2, block_size=16, cache_tokens=2048, timeout_s=60)
    first = engine.generate(["the cat"], max_new_tokens=4)[0].token_ids

    def ctrl_c():  # once the long request runs, SIGINT to the whole process group: a terminal's Ctrl-C
        while engine.stats()["running"] == 0:
            time.sleep(0.01)
        os.killpg(os.getpgrp(), signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        engine.generate(["the cat"], max_new_tokens=400)
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
    deadline = time.monotonic() + 60
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    print("running", engine.stats()["running"], "healthy", engine.healthy)
    print("again", engine.generate(["the cat"], max_new_tokens=4)[0].token_ids == first)
    engine.close()


if __name__ == "__main__":
    main()
"""


def test_ctrl_c_during_generate_cancels_the_request_and_keeps_the_engine(model_file, tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    done = subprocess.run([sys.executable, str(script), str(model_file)], capture_output=True, text=True, timeout=300,
                          start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=default_signals)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["interrupted", "running 0 healthy True",
                                           "again True"], done.stdout + done.stderr[-3000:]
