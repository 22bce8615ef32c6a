"""What runs on every rank of an engine: the driver (treeattn.engine) sends each step's plan, these run it.

    rank.py             one rank's loop over the plans (started by engine/transport.py)
    runner.py           RankRunner: runs one plan (prefill chunks and decode rows) on this rank
    batch.py            a step's PagedBatch: kv_store / attend over the paged, sequence-sharded cache
    static_step.py      the fixed-shape decode step (eager, or replayed from CUDA graphs)
    ring_prefill.py, token_parallel.py, shared_prefix.py   how a step splits across the ranks
    draft.py            the draft model's forward passes (speculate="draft")
    sampling.py         one token from logits; prompt_logprobs.py: the prompt's log-probabilities
    tensor_parallel.py  the tensor-parallel plan applied to a loaded model (Helix layout)
    warmup.py           the kernels' warm-up before the first step

Nothing here is imported by the driver's modules but the rank's entry point (engine/transport.py)
and the tensor-parallel checks (engine/checks.py, engine/memory.py).
"""
