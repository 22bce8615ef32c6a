"""Session 18 (pre18): process CPU seconds of one dequantization of every packed layer of MODEL but the embedding, before
(dequantize_packed until d413819: the concatenated temporaries) and after, alternated, on THREADS torch threads.

    PYTHONPATH=src python3 docs/data/pre18_dequant_layers.py MODEL THREADS
"""
import collections
import sys
import time

import torch

import treeattn as ta
from treeattn.models.packed import _Packed
from treeattn.ops.packed_linear import dequantize_packed


def concatenated(fmt, qs, d, m):  # dequantize_packed before d413819
    q = qs.to(torch.float32) if fmt == "q8_0" else torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.float32)
    if fmt == "q4_0":
        q -= 8.0
    w = q * d[..., None]
    if m is not None:
        w += m[..., None]
    return w.reshape(*qs.shape[:-2], -1)


torch.set_num_threads(int(sys.argv[2]))
m = ta.load_model(sys.argv[1], weight_format="packed")
layers = [l for n, l in m.named_modules() if isinstance(l, _Packed) and "embed" not in n]
fmts = collections.Counter((l.fmt, str(l.qs.dtype)) for l in layers); print(fmts)
def total(f):
    s = time.process_time()
    for l in layers:
        f(*l._parts())
    return time.process_time() - s
for r in range(6):
    print("before", round(total(concatenated), 3), "after", round(total(dequantize_packed), 3), "CPU s for every layer once")
