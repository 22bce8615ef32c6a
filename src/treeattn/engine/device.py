"""Where the ranks run: the device kind, each rank's device, the process group's backend, the default dtype.

    kind = resolve_device("auto")                 # "cuda" where torch sees a GPU, else "cpu"
    check_gpus(kind, ranks=2)                     # more ranks on this machine than GPUs: ConfigError naming nproc
    device = rank_device(kind, rank=1)            # cuda:1 (spawned rank r: cuda:r; under torchrun cuda:LOCAL_RANK)
    backend_for(kind)                             # "nccl" for CUDA ranks, "gloo" for CPU ranks
    dtype = resolve_dtype(None, kind)             # bfloat16 on CUDA, float32 on the CPU

Every refusal is a ConfigError (a ValueError) with one line that names the option: "device" for a
CUDA device that is not there, "nproc" for more ranks than GPUs.
"""

from __future__ import annotations

import os

import torch

from treeattn.engine.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """The device kind the ranks run on: "cpu" or "cuda" ("auto": "cuda" where CUDA is available).

    Raises:
        ConfigError("device") for a name outside DEVICES, or "cuda" without a CUDA device.
    """
    if device not in DEVICES:
        raise ConfigError("device", f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        raise ConfigError("device", f"device='cuda' needs a CUDA device, but torch sees none (torch {torch.__version__}, "
                                    f"built with {built}); use device='cpu' or device='auto'")
    return device


def check_gpus(kind: str, ranks: int) -> None:
    """`ranks` ranks on this machine need a GPU each when `kind` is "cuda" (ConfigError naming nproc)."""
    if kind != "cuda":
        return
    count = torch.cuda.device_count()
    if ranks > count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        fewer = f"nproc={count} (one rank per GPU)" if count else "device='cpu'"
        raise ConfigError("nproc", f"nproc={ranks}: {ranks} CUDA ranks on this machine need one GPU each, but {count} GPU(s) "
                                   f"are visible{where}; use {fewer}, or device='cpu' to run the ranks on the CPU")


def rank_device(kind: str, rank: int) -> torch.device:
    """The device of rank `rank` (its rank in the world): for CUDA, cuda:LOCAL_RANK under torchrun,
    else cuda:rank % device_count (ta.spawn starts every rank on this machine and sets that device
    for NCCL); the CPU otherwise."""
    from treeattn.parallel.spawn import under_torchrun

    if kind != "cuda":
        return torch.device("cpu")
    if under_torchrun():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", rank % torch.cuda.device_count())


def backend_for(kind: str) -> str:
    """The process group's backend for ranks on `kind`: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if kind == "cuda" else "gloo"


def resolve_dtype(dtype: torch.dtype | None, kind: str) -> torch.dtype:
    """The parameters' dtype: `dtype`, or by default (None, "auto") bfloat16 on CUDA and float32 on the CPU."""
    if dtype is not None:
        return dtype
    return torch.bfloat16 if kind == "cuda" else torch.float32
