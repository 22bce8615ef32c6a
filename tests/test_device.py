"""Devices: the device kind, each rank's device, the backend, the default dtype, and their refusals
(treeattn.engine.device); the CUDA paths run under `pytest -m gpu` where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from treeattn.engine.device import backend_for, check_gpus, rank_device, resolve_device, resolve_dtype
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
