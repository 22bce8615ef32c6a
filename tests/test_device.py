"""Devices: the device kind, each rank's device, the backend, the default dtype, and their refusals
(treeattn.engine.device); the CUDA paths run under `pytest -m gpu` where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from treeattn.engine.device import backend_for, check_gpus, rank_device, resolve_device, resolve_dtype
from treeattn.engine.config import EngineConfig
from treeattn.engine.errors import ConfigError


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_auto_is_the_cpu_without_cuda(no_cuda):
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    assert resolve_dtype(None, "cpu") == torch.float32 and resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl"


def test_cuda_without_cuda_is_one_line_naming_device(no_cuda):
    with pytest.raises(ConfigError, match=r"^device='cuda' needs a CUDA device, but torch sees none") as info:
        resolve_device("cuda")
    assert info.value.option == "device" and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^device must be one of \('auto', 'cpu', 'cuda'\), got 'tpu'"):
        resolve_device("tpu")


def test_more_ranks_than_gpus_is_one_line_naming_nproc_and_the_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    check_gpus("cuda", 2)
    check_gpus("cpu", 8)
    with pytest.raises(ConfigError, match=r"^nproc=3: 3 CUDA ranks on this machine need one GPU each, but 2 GPU\(s\) are "
                                          r"visible \(CUDA_VISIBLE_DEVICES=0,1\)") as info:
        check_gpus("cuda", 3)
    assert info.value.option == "nproc"


def test_rank_r_runs_on_cuda_r_or_local_rank_under_torchrun(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert [rank_device("cuda", r) for r in range(3)] == [torch.device("cuda", r) for r in range(3)]
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("cuda", 5) == torch.device("cuda", 1)


# ---------------------------------------------------------------------------------------------- the engine

def tiny_model():
    from treeattn.models.llama import LlamaConfig, random_model

    return random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16, max_position_embeddings=128))


def test_engine_refuses_cuda_without_cuda_before_any_work(no_cuda, monkeypatch):
    import treeattn as ta
    from treeattn.engine import transport

    monkeypatch.setattr(transport, "SpawnedRanks", lambda *a, **k: pytest.fail("no rank may start"))
    monkeypatch.setattr(transport, "GroupChannel", lambda *a, **k: pytest.fail("no rank may start"))
    with pytest.raises(ConfigError, match=r"^device='cuda' needs a CUDA device") as info:
        ta.Engine(tiny_model(), nproc=2, device="cuda", block_size=16, cache_tokens=128)
    assert info.value.option == "device"
    with pytest.raises(ConfigError, match=r"^device must be one of"):
        EngineConfig(device="gpu")


def test_engine_on_the_cpu_by_default_and_by_name(no_cuda):
    import treeattn as ta

    model = tiny_model()
    runs = {}
    for device in ("auto", "cpu"):
        with ta.Engine(model, nproc=1, device=device, block_size=16, cache_tokens=128) as engine:
            assert engine.config.device == "cpu"
            runs[device] = engine.generate([1, 2, 3], max_new_tokens=4)[0].token_ids
    assert runs["auto"] == runs["cpu"]


def test_memory_check_names_the_gpus_free_memory(monkeypatch):
    from treeattn.engine import memory

    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 3 << 30)
    memory.check_memory_fit(ranks=1, weights=1 << 30, cache=1 << 30, draft=0, device="cuda:1", cache_option="cache_tokens")
    with pytest.raises(ConfigError,
                       match=r"^cache_tokens: 1 rank\(s\) x \(1.0 GiB of weights \+ 4.0 GiB of KV cache\) = 5.0 GiB, "
                                          r"more than the 3.0 GiB free on cuda:1$"):
        memory.check_memory_fit(ranks=1, weights=1 << 30, cache=4 << 30, draft=0, device="cuda:1", cache_option="cache_tokens")


def test_serve_refuses_cuda_without_cuda_in_one_line(no_cuda, tmp_path):
    from typer.testing import CliRunner

    from treeattn.cli import app

    tmp_path.joinpath("config.json").write_text("{}")  # never read: the flag is refused first
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "cuda"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treeattn serve: error: --device cuda needs a CUDA device"), result.output


@pytest.mark.parametrize("command", [["demo"], ["demo", "--synthetic"], ["demo", "--long"], ["eval", "needle", "missing.gguf"]],
                         ids=" ".join)
def test_demo_and_eval_refuse_cuda_without_cuda_in_one_line(no_cuda, command):
    """Every command that runs a model takes --device; without CUDA, `--device cuda` is one line naming
    the flag, before any model is looked for (no traceback, exit status 2)."""
    from typer.testing import CliRunner

    from treeattn.cli import app

    result = CliRunner().invoke(app, [*command, "--device", "cuda", "--dtype", "auto"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda needs a CUDA device, but torch sees none"), result.stderr
    assert "Traceback" not in result.output


# ------------------------------------------------------------------- CUDA (pytest -m gpu; skipped without a GPU)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_a_model_runs_on_the_gpu_with_the_cpus_tokens():
    import treeattn as ta

    model = tiny_model()
    tokens = {}
    for device in ("cpu", "cuda"):
        with ta.Engine(model, nproc=1, device=device, dtype=torch.float32, block_size=16, cache_tokens=128) as engine:
            runner = engine._channel.runner
            assert runner.model.device.type == device and runner.cache.arena.device.type == device
            tokens[device] = engine.generate([1, 2, 3, 4], max_new_tokens=6)[0].token_ids
    assert tokens["cuda"] == tokens["cpu"]


@pytest.mark.gpu
@needs_cuda
def test_a_checkpoint_loads_onto_the_gpu_in_bfloat16_and_the_memory_check_reads_free_memory(tmp_path):
    pytest.importorskip("transformers")
    from helpers.llama_checkpoints import make_checkpoint

    import treeattn as ta

    make_checkpoint("llama", tmp_path / "llama")
    with ta.Engine(str(tmp_path / "llama"), nproc=1, device="auto", block_size=16, cache_tokens=128) as engine:
        model = engine._channel.runner.model
        assert model.device == torch.device("cuda", torch.cuda.current_device()) and model.dtype == torch.bfloat16
        assert len(engine.generate([1, 2, 3], max_new_tokens=3)[0].token_ids) == 3
    from treeattn.cache.sharded import kv_bytes_per_token
    from treeattn.models.loader import read_config

    per_token = kv_bytes_per_token(read_config(tmp_path / "llama"), torch.bfloat16)
    tokens = 16 * (torch.cuda.mem_get_info()[0] // per_token // 16 + 1)  # more KV cache than the GPU has free
    with pytest.raises(ConfigError, match=r"^cache_tokens: .* free on cuda:"):
        ta.Engine(str(tmp_path / "llama"), nproc=1, device="cuda", block_size=16, max_context=64, cache_tokens=tokens)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_cuda_ranks_form_an_nccl_group_with_the_cpus_tokens():
    import treeattn as ta

    model = tiny_model()
    tokens = {}
    for device in ("cpu", "cuda"):
        with ta.Engine(model, nproc=2, device=device, dtype=torch.float32, block_size=16, cache_tokens=256) as engine:
            tokens[device] = engine.generate([1, 2, 3, 4], max_new_tokens=6)[0].token_ids
    assert tokens["cuda"] == tokens["cpu"]


def test_generate_takes_a_device(no_cuda):
    import treeattn as ta

    model = tiny_model()
    base = ta.generate(model, [1, 2, 3], max_new_tokens=4, ignore_eos=True, block_size=16).generated_ids
    assert ta.generate(model, [1, 2, 3], max_new_tokens=4, ignore_eos=True, block_size=16, device="cpu").generated_ids == base
    with pytest.raises(ConfigError, match=r"^device='cuda' needs a CUDA device"):
        ta.generate(model, [1, 2, 3], max_new_tokens=4, device="cuda")


def test_generate_command_device_cpu_dtype_auto_gives_the_defaults_tokens(no_cuda, tmp_path):
    import json

    from typer.testing import CliRunner

    pytest.importorskip("transformers")
    from helpers.llama_checkpoints import make_checkpoint

    from treeattn.cli import app

    make_checkpoint("llama", tmp_path / "llama")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([3, 4, 5, 6, 7]))
    args = ["generate", str(tmp_path / "llama"), "--prompt-ids", str(ids), "--max-new-tokens", "4", "--json"]
    runner = CliRunner()
    default, explicit = (runner.invoke(app, args + extra) for extra in ([], ["--device", "cpu", "--dtype", "auto"]))
    assert default.exit_code == 0 and explicit.exit_code == 0, (default.output, explicit.output)
    assert json.loads(explicit.stdout)["generated_ids"] == json.loads(default.stdout)["generated_ids"]
    refused = runner.invoke(app, args + ["--device", "cuda"])
    assert refused.exit_code == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda needs a CUDA device, but torch sees none"), (
        refused.stderr
    )
    with pytest.MonkeyPatch.context() as mp:  # a machine with one GPU, asked for two CUDA ranks
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        refused = runner.invoke(app, args + ["--device", "cuda", "--nproc", "2"])
    assert refused.exit_code == 2
    lines = refused.stderr.strip().splitlines()
    assert lines == ["error: --nproc 2: 2 CUDA ranks on this machine need one GPU each, but 1 GPU(s) are visible; use "
                     "--nproc 1 (one rank per GPU), or --device cpu to run the ranks on the CPU"], refused.stderr


@pytest.mark.gpu
@needs_cuda
def test_generate_command_runs_dynamic_static_and_graph_steps_on_the_gpu(tmp_path):
    import json

    from typer.testing import CliRunner

    pytest.importorskip("transformers")
    from helpers.llama_checkpoints import make_checkpoint

    from treeattn.cli import app

    make_checkpoint("llama", tmp_path / "llama")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([3, 4, 5, 6, 7]))
    tokens = {}
    for step in ("dynamic", "static", "graph"):
        result = CliRunner().invoke(app, ["generate", str(tmp_path / "llama"), "--prompt-ids", str(ids), "--max-new-tokens", "6",
                                          "--device", "cuda", "--dtype", "float32", "--decode-step", step, "--json"])
        assert result.exit_code == 0, result.output
        tokens[step] = json.loads(result.stdout)["generated_ids"]
    assert tokens["static"] == tokens["dynamic"] and tokens["graph"] == tokens["dynamic"]
