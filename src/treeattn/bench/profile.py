"""Where one decode token's time goes, on each rank: `treeattn bench profile MODEL --nproc 1,2,4`.

A synthetic prompt of `context` tokens is prefilled and decoded greedily (no stop token) by a
ta.Engine on `p` local gloo ranks (tree decoding), once per tree_decode method and transport, and
every decode step is split, on every rank, from the engine's own measurements
(Engine.rank_measurements, treeattn.engine.measure):

    attention   this rank's local attention over its shard, all layers
    combine     the cross-rank combine of the layer states (tree_decode's combine_states:
                communication, waiting for the other ranks, merge), all layers
    sampling    rank 0: logits (the lm_head projection), the non-finite check and sampling; the
                other ranks nothing, except where the projection is split by vocabulary
                (engine.worker.runner.VOCAB_SPLIT_MIN_WEIGHTS: SmolLM2's is): then every rank projects
                its share and takes part in the logits' all-gather (one more round a step)
    model       the rest of the step: embeddings, norms, projections, RoPE, MLPs, the cache
                writes, the step's index bookkeeping

"step" is the rank's wall time of the step (RankMeasurements.step_s); model = step - the three
measured phases. The split is exact when the engine reads a shard in place (the paged decode
kernel, treeattn.ops.paged_decode: decoding on the CPU in float32 with numba, or on CUDA) or run
by run (long runs of blocks: engine.worker.batch.COPY_FREE_MIN_KEYS keys a run on average); on a
gathered shard the back end's combine is inside "attention". What happens between
steps (the driver's scheduling and the plan's broadcast) is not in the step. Each figure is the
mean over the steps after `warmup`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PHASES = ("attention", "combine", "sampling", "model")

# A random-weight stand-in with SmolLM2-135M's shapes (30 layers), for machines without its GGUF file.
SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=1 << 20)


@dataclass
class ProfileSpec:
    """One profile run. model: "demo" (treeattn demo's model), "smollm2-shapes" (random weights,
    SMOLLM2_SHAPES) or a checkpoint (HF directory or .gguf file). The methods run in turn
    `repeats` times, so that a machine whose load drifts weighs on every method alike; a method's
    figures are the means over all its runs."""

    model: str
    context: int
    new_tokens: int
    methods: tuple[str, ...]
    threads: int
    transports: tuple[str, ...] = ("shm",)  # "shm": shared memory (treeattn.parallel.shared_memory), "gloo"
    warmup: int = 2
    seed: int = 0
    repeats: int = 1
    device: str = "cpu"  # "cpu" or "cuda" (resolved by the caller: treeattn.engine.device.resolve_device)
    dtype: torch.dtype | None = None  # None: bfloat16 on CUDA, float32 on the CPU
    weight_format: str = "auto"  # a GGUF checkpoint's weights: EngineConfig.weight_format
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype
    activation_format: str = "auto"  # how packed weights multiply decode steps: EngineConfig.activation_format


def build_model(name: str, seed: int, device: str = "cpu", dtype: torch.dtype | None = None, rank: int = 0,
                weight_format: str = "auto"):
    """The model of a ProfileSpec (the same weights on every rank), on this rank's device
    (treeattn.engine.device.rank_device) in `dtype` (None: bfloat16 on CUDA, float32 on the CPU);
    a GGUF checkpoint's weights in `weight_format` (treeattn.models.loader.load_model)."""
    from treeattn.engine.device import rank_device, resolve_dtype
    from treeattn.models.synthetic import DEMO_CONFIG
    from treeattn.models.llama import LlamaConfig, random_model

    where, dtype = rank_device(device, rank), resolve_dtype(dtype, device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if name in ("demo", "smollm2-shapes"):
        config = LlamaConfig(**(DEMO_CONFIG if name == "demo" else SMOLLM2_SHAPES))
        return random_model(config, seed=seed).to(device=where, dtype=dtype)
    from treeattn.models.loader import load_model

    return load_model(name, dtype=dtype, device=where, weight_format=weight_format, with_tokenizer=False)


def variant_name(method: str, transport: str) -> str:
    """How a (method, transport) run is named in the reports: "onepass (shm)"."""
    return f"{method} ({transport})"


def profile_rank(rank: int, world_size: int, spec: ProfileSpec) -> list[dict] | None:
    """One rank: an engine per method and transport (a prefill and the decode each). Returns on rank
    0, for every rank, per variant_name, its phase means, the generated ids and the decode rounds
    (comm_stats); None on the other ranks."""
    from treeattn.models.synthetic import synthetic_prompt
    from treeattn.engine.client import Engine

    torch.set_num_threads(spec.threads)
    model = build_model(spec.model, spec.seed, spec.device, spec.dtype, rank, spec.weight_format)
    prompt = synthetic_prompt(spec.context, model.config.vocab_size, spec.seed)
    group = dist.group.WORLD if world_size > 1 else None
    variants = [(method, transport) for method in spec.methods for transport in spec.transports]
    runs: dict[str, list] = {variant_name(*v): [] for v in variants}
    positions = spec.context + spec.new_tokens
    for _ in range(spec.repeats):
        for method, transport in variants:
            with Engine(model, group=group, decode="tree" if world_size > 1 else "local", method=method, device=spec.device,
                        shared_memory=transport == "shm", max_batch_size=1, prefix_cache=False, block_size=256,
                        cache_tokens=positions + 256 * world_size, max_context=positions, timeout_s=600.0,
                        kv_cache_dtype=spec.kv_cache_dtype, activation_format=spec.activation_format) as engine:
                if engine.is_driver:
                    result, = engine.generate([prompt], max_new_tokens=spec.new_tokens, ignore_eos=True)
                    runs[variant_name(method, transport)].append((result.token_ids, engine.rank_measurements()))
    if world_size > 1:
        dist.barrier()
    if rank != 0:
        return None
    return [_rank_report(runs, r, spec.warmup) for r in range(world_size)]


def _rank_report(runs: dict[str, list], rank: int, warmup: int) -> dict:
    """One rank's figures per variant from every run's (token ids, RankMeasurements of every rank)."""
    report = {}
    for name, done in runs.items():
        means = [_phase_means(measured[rank], warmup) for _, measured in done]
        ids, measured = done[0]
        comm = measured[rank].comm["decode"]
        report[name] = {"phases": {k: sum(m[k] for m in means) / len(means) for k in means[0]},
                        "generated_ids": ids, "same_ids_every_run": all(other == ids for other, _ in done),
                        "rounds_per_step": comm["rounds"] / max(1, measured[rank].steps["decode"]), "runs": len(done)}
    return report


def _phase_means(measured, warmup: int) -> dict[str, float]:
    """Mean seconds per decode step of each phase and of the whole step ("step"), over the decode
    steps after the first `warmup`."""
    steps = list(zip(measured.step_phases["decode"], measured.step_s["decode"]))
    kept = steps[warmup:] or steps
    means = {phase: sum(p.get(phase, 0.0) for p, _ in kept) / len(kept) for phase in PHASES if phase != "model"}
    means["step"] = sum(s for _, s in kept) / len(kept)
    means["model"] = max(0.0, means["step"] - sum(means[p] for p in PHASES if p != "model"))
    return means


def run_profile(spec: ProfileSpec, nproc: int) -> list[dict]:
    """profile_rank on `nproc` local ranks (in this process for 1). Returns every rank's report."""
    if nproc == 1:
        return profile_rank(0, 1, spec)
    from treeattn.engine.device import backend_for
    from treeattn.parallel import spawn

    return spawn(profile_rank, nproc, spec, backend=backend_for(spec.device), timeout=3600, threads=spec.threads)[0]
