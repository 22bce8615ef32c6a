"""Do the head's logits keep their bits when the chunk's columns or the block's rows change? (MKL's sgemm, this host)

    PYTHONPATH=src python3 docs/data/logp24/chunk_bits.py

SmolLM2's head as score_rows multiplies it (_Head.of), 512 random hidden rows: F.linear over 4096 columns at once
against the same columns in chunks of 512, 1024, 2048, and against two 256-row halves, on 1 and 2 torch threads.
If every line says True, CHUNK_BYTES and ROWS_PER_BLOCK can be tuned (a quiet sweep) without moving a value or a rank."""
import torch
from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs as pl
from treeattn.models import load_model

torch.set_grad_enabled(False)
W = pl._Head.of(load_model(harness.default_model())).weight
h = torch.randn(512, W.shape[1], generator=torch.Generator().manual_seed(0))
print("cpu:", harness.cpu_model(), "torch", torch.__version__)
for threads in (1, 2):
    torch.set_num_threads(threads)
    whole = torch.nn.functional.linear(h, W[:4096])
    for cols in (512, 1024, 2048):
        parts = torch.cat([torch.nn.functional.linear(h, W[j : j + cols]) for j in range(0, 4096, cols)], 1)
        print(f"threads {threads}, chunks of {cols} columns: bits equal {torch.equal(whole, parts)}")
    halves = torch.cat([torch.nn.functional.linear(h[:256], W[:4096]), torch.nn.functional.linear(h[256:], W[:4096])])
    print(f"threads {threads}, two 256-row blocks: bits equal {torch.equal(whole, halves)}")
