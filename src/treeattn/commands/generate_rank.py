"""One rank of `treeattn generate`: load the model, run one Generation, hand rank 0's result back.

    job = GenerateJob(model_dir="path/to/model", prompts=((1, 2, 3),), config=EngineConfig(decode="tree"),
                      sampling=SamplingParams(max_new_tokens=8))
    results = ta.spawn(generate_rank, 4, job)        # results[0]: GenerationResult.as_dict()

The options were validated once, by the caller, before the ranks started (EngineConfig,
SamplingParams, and generate's checks of the batch: treeattn.engine.generate.check_generation and
the engine's checks); with `checked` the ranks hand that proof on (treeattn.engine.checks.Checked,
for the model each loads from model_dir) and nothing is checked again. Generation still checks
that every rank got the same options (one all-gather). Progress
display is the caller's: `display` (picklable, treeattn.commands.console.GenerateDisplay) is used on
rank 0 only.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from treeattn.engine.config import EngineConfig
from treeattn.engine.request import SamplingParams


@dataclass(frozen=True)
class GenerateJob:
    """What every rank runs.

    Attributes:
        model_dir: checkpoint to load (every rank loads all weights, or with config.tp its share of them).
        prompts: token ids, one tuple per sequence.
        config: the validated EngineConfig (generate sizes it to the batch; with `checked`, sized already).
        sampling: the validated SamplingParams of every sequence.
        num_samples: completions of the one prompt (generate's num_samples).
        dtype: parameter dtype name ("float32", "bfloat16", "float16").
        device: "cpu" or "cuda" (rank r on treeattn.engine.device.rank_device: cuda:r, or cuda:LOCAL_RANK under torchrun).
        threads: torch threads per rank (None: torch's default).
        checked: config is the batch-sized config the caller checked for model_dir (checks.check_engine,
            generate.check_generation): every rank runs it as checked.
    """

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    config: EngineConfig
    sampling: SamplingParams
    num_samples: int = 1
    dtype: str = "float32"
    threads: int | None = None
    device: str = "cpu"
    checked: bool = False


def generate_rank(rank: int, world_size: int, job: GenerateJob, display=None) -> dict | None:
    """Run `job` as rank `rank` of `world_size` (inside ta.spawn or torchrun; world_size 1 needs no
    group). Returns GenerationResult.as_dict() on rank 0, None on the others.

    `display` (rank 0 only; treeattn.commands.console.GenerateDisplay or None) is told when the model
    is loaded, how far the prefill is, and each new token."""
    import time

    import torch

    from treeattn.engine.generate import Generation
    from treeattn.models.loader import load_model

    show = display is not None and rank == 0
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    start = time.perf_counter()
    from treeattn.engine.device import rank_device

    device = rank_device(job.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shard = None
    if job.config.tp is not None and world_size > 1:  # the Helix layout: this rank reads its share of the weights
        from treeattn.engine.worker.tensor_parallel import HelixLayout, tensor_parallel_cuts
        from treeattn.models.loader import read_config

        shard = tensor_parallel_cuts(read_config(job.model_dir), HelixLayout(world_size, job.config.tp, rank))
    model = load_model(job.model_dir, dtype=getattr(torch, job.dtype), device=device, weight_format=job.config.weight_format,
                       shard=shard)
    if show:
        display.loaded(time.perf_counter() - start)
    if show and world_size > 1:  # a ring prefill step is the whole prompt: show its progress layer by layer
        layers = len(model.layers)
        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(lambda module, args, output, i=i: display.on_layer(i, layers))
    config = job.config
    if job.checked:  # checked by the caller for model_dir, which this rank just loaded: handed on, not checked again
        from treeattn.engine.checks import Checked, model_files

        config = Checked(config, model, model_files(model))
    run = Generation(model, [list(p) for p in job.prompts], config, job.sampling, num_samples=job.num_samples,
                     on_prefill=display.on_prefill if show else None)
    longest = max(len(p) for p in job.prompts)
    with display.run(getattr(model, "tokenizer", None), world_size, longest,
                     job.sampling.max_new_tokens) if show else nullcontext() as on_token:
        for step in run:
            if on_token is not None:
                on_token(step)
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # leave together: a rank tearing its group down early can abort a peer still in gloo
    return run.result.as_dict() if rank == 0 else None
