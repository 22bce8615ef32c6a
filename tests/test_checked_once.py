"""The engine's checks run once for one generate (issue 53): ta.generate checks its batch-sized config
and hands the Engine it starts the proof (treeattn.engine.checks.Checked); `treeattn generate` checks
before spawning and its ranks hand the proof on. Rank 0 samples from the plan the driver made (with the
fields the int32 wire to the other ranks leaves out), so a penalized answer on spawned ranks is one process's."""

from __future__ import annotations

import gguf
import pytest
import torch

import treeattn as ta
from treeattn.engine import EngineConfig, checks, client, generate
from treeattn.models.llama import LlamaConfig, random_model


def _count_checks(monkeypatch) -> list[str]:
    """Patch check_engine wherever it is called from; the list gets one entry per call."""
    calls: list[str] = []
    real = checks.check_engine

    def counted(model, config, **kwargs):
        calls.append(type(model).__name__)
        return real(model, config, **kwargs)

    for module in (checks, client, generate):
        monkeypatch.setattr(module, "check_engine", counted)
    return calls


def _model():
    torch.manual_seed(0)
    return random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16, max_position_embeddings=128))


def test_ta_generate_checks_once(monkeypatch):
    calls = _count_checks(monkeypatch)
    result = ta.generate(_model(), [1, 2, 3], max_new_tokens=4, block_size=16)
    assert len(result.generated_ids[0]) == 4
    assert calls == ["LlamaModel"]  # Generation's check; the Engine it starts trusts the proof


def test_an_engine_checks_a_config_it_has_no_proof_for(monkeypatch):
    calls = _count_checks(monkeypatch)
    model = _model()
    config = checks.with_device(model, EngineConfig(nproc=1, block_size=16, cache_tokens=128))
    other = checks.Checked(config, _model(), checks.model_files(model))  # a proof for another model object
    with ta.Engine(model, other) as engine:
        assert len(engine.generate([1, 2], max_new_tokens=2)[0].token_ids) == 2
    assert calls == ["LlamaModel"]


def test_a_bad_option_still_fails_before_work():
    with pytest.raises(ValueError, match="max_context"):
        ta.generate(_model(), [1, 2, 3], max_new_tokens=8, max_context=4, block_size=16)


def test_treeattn_generate_checks_once(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from gguf_files import write_gguf
    from helpers.gguf_models import hf_model
    from typer.testing import CliRunner

    from treeattn.cli import app

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.F16, context_length=256)
    calls = _count_checks(monkeypatch)
    result = CliRunner().invoke(app, ["generate", str(path), "--prompt-ids", _ids(tmp_path), "--max-new-tokens", "3",
                                      "--nproc", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert calls == ["str"]  # before spawning, on the checkpoint's path; the rank and its Engine trust it


def _ids(tmp_path) -> str:
    path = tmp_path / "ids.json"
    path.write_text("[1, 2, 3]")
    return str(path)


def test_rank_0_samples_with_what_the_ranks_wire_leaves_out(tmp_path):
    """Repetition and frequency penalties and a logit bias reach rank 0 of spawned ranks (a checkpoint path:
    the driver sends each plan over its connection): 2 ranks give one process's greedy tokens. Session 13
    briefly sent rank 0 the int32 words, which carry none of them, and chat's answers changed on 2 ranks."""
    pytest.importorskip("transformers")
    from gguf_files import write_gguf
    from helpers.gguf_models import hf_model

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.Q8_0, context_length=256)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    penalized = ta.SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.7,
                                  logit_bias={7: 5.0})
    answers = {}
    for nproc in (1, 2):
        with client.Engine(str(path), EngineConfig(nproc=nproc, decode="local" if nproc == 1 else "tree",
                                                   max_batch_size=1)) as engine:
            answers[nproc] = [engine.generate(prompt, sampling)[0].token_ids
                              for sampling in (penalized, ta.SamplingParams(max_new_tokens=12, ignore_eos=True))]
    assert answers[2] == answers[1]
    assert answers[1][0] != answers[1][1]  # the controls changed the answer, so the test can fail
