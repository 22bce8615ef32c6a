"""Test-wide settings.

TREEATTN_TEST_DEVICE=cuda runs the single-process tests on CUDA tensors: the default torch device
becomes that device, so every tensor a test creates without naming a device lives there, and a
torch.Generator made without a device is made on it too (random draws then differ from the CPU's,
which no test depends on: every check compares against a reference on the same inputs). Tests that
spawn ranks create their tensors in the rank processes, which stay on the CPU.
"""

import os

import torch

_device = os.environ.get("TREEATTN_TEST_DEVICE")
if _device:
    torch.set_default_device(_device)

    class _DefaultDeviceGenerator(torch.Generator):
        def __new__(cls, device=None):
            return super().__new__(cls, device if device is not None else _device)

        def __init__(self, device=None):
            pass

    torch.Generator = _DefaultDeviceGenerator
