"""ops.logits_cpu_kernel against float64 and torch's reductions (session 23, logp23): exp2 over [-126, 0] and a chunk's
sums of exponentials for random logits at several scales. Run: PYTHONPATH=src python3 docs/data/logp23/kernel_accuracy.py"""
import numpy as np
import torch

from treeattn.ops import logits_cpu_kernel as k

y = np.linspace(-126, 0, 20_001, dtype=np.float32)
got = np.array([k._exp2(v) for v in y], dtype=np.float64)
print("exp2: max relative error against float64 over 20,001 points of [-126, 0]:", np.abs(got / np.exp2(y.astype(np.float64)) - 1).max())
torch.set_num_threads(1)
for scale in (0.3, 3.0, 30.0):
    logits = (torch.randn(512, 2048, generator=torch.Generator().manual_seed(0)) * scale).float()
    target = logits[:, 5].contiguous()
    maxes, sums, larger = (np.empty(512, dtype=np.float32) for _ in range(3))
    k.reduce_chunk(logits.numpy(), target.numpy(), 0, maxes, sums, larger, np.zeros((512, 0), np.float32), np.zeros((512, 0), np.int64))
    exact = torch.exp(logits.double() - logits.double().amax(dim=1, keepdim=True)).sum(dim=1).numpy()
    torch_sums = torch.exp2((logits - logits.amax(dim=1, keepdim=True)) * 1.4426950408889634).sum(dim=1).numpy()
    print(f"scale {scale}: kernel sums vs float64 max rel {np.abs(sums / exact - 1).max():.3g}, torch's float32 sums vs float64 "
          f"{np.abs(torch_sums / exact - 1).max():.3g}; max equal {np.array_equal(maxes, logits.amax(1).numpy())}, counts equal "
          f"{np.array_equal(larger, (logits > target[:, None]).sum(1).float().numpy())}")
