"""Test-wide settings.

TREEATTN_TEST_DEVICE=cuda runs the single-process tests on CUDA tensors: the default torch device
becomes that device, so every tensor a test creates without naming a device lives there. Tests
that spawn ranks create their tensors in the rank processes, which stay on the CPU.
"""

import os

import torch

_device = os.environ.get("TREEATTN_TEST_DEVICE")
if _device:
    torch.set_default_device(_device)
