"""Where one decode token's time goes, on each rank: `treeattn bench profile MODEL --nproc 1,2,4`.

A generation runs on `p` local gloo ranks (a synthetic prompt of `context` tokens, greedy decoding,
no stop token), once per tree_decode method from the same prefilled cache, and every decode step
is split, on every rank, into:

    attention   this rank's local attention over its shard (ops.attention), all layers
    combine     the cross-rank combine of the layer states (treeattn.parallel.combine_states:
                communication and merge), all layers
    model       the rest of the forward pass: embeddings, norms, projections, RoPE, MLPs, the
                cache writes of the layers
    sampling    rank 0: logits (the lm_head projection), the non-finite check, sampling and the
                chosen tokens' log-probabilities; the other ranks do nothing here
    broadcast   the broadcast of the new tokens from rank 0 (on the other ranks: waiting for
                rank 0 to finish sampling)
    host        everything else in the step: the attention call's input checks and glue, the
                cache's slot bookkeeping, the generation loop

"step" is the wall time of the step as the generation measures it (GenerationResult.step_times_s);
host = step - the five measured phases. The attention of a profiled step runs the two halves of
tree_decode(check_inputs=False) -- decode_inputs, ops.attention, combine_states -- with a
clock between them; everything else is the engine's own code. Each figure is the mean over the
steps after `warmup`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from treeattn.generate import Generation
from treeattn.models.attention import LocalAttention, TreeAttention
from treeattn.ops import attention
from treeattn.parallel.inputs import decode_inputs
from treeattn.parallel.packing import accumulation_dtype
from treeattn.parallel.tree_decode import combine_states

PHASES = ("attention", "combine", "model", "sampling", "broadcast", "host")

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


class _Clock:
    """Seconds per phase of the step being recorded; one dict per step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None

    def start_step(self) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        self.steps.append(self.current)

    def add(self, phase: str, seconds: float) -> None:
        if self.current is not None:
            self.current[phase] += seconds


class _TimedTreeAttention(TreeAttention):
    """TreeAttention whose tree_decode(check_inputs=False) runs in its two timed halves."""

    def __init__(self, method: str, group, clock: _Clock) -> None:
        super().__init__(method, group)
        self.clock = clock

    def _combine(self, q, k, v, q_pos, kv_pos):
        inputs = decode_inputs(q, k, v, None, q_pos, kv_pos, None, check=False)
        start = time.perf_counter()
        out, lse = attention(q, k, v, scale=inputs.scale, causal=inputs.masked, q_pos=inputs.q_pos, kv_pos=inputs.kv_pos)
        acc = accumulation_dtype(q.dtype)
        out, lse = out.to(acc), lse.to(acc)
        local_done = time.perf_counter()
        out, lse = combine_states(out, lse, group=self.group, method=self.method)
        self.clock.add("attention", local_done - start)
        self.clock.add("combine", time.perf_counter() - local_done)
        return out.to(q.dtype)


class _TimedLocalAttention(LocalAttention):
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def __call__(self, q, k, v, *, q_pos, kv_pos, window):
        start = time.perf_counter()
        out = super().__call__(q, k, v, q_pos=q_pos, kv_pos=kv_pos, window=window)
        self.clock.add("attention", time.perf_counter() - start)
        return out


class ProfiledGeneration(Generation):
    """A Generation that records, per decode step, the seconds of each phase (see the module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = _Clock()
        if self.world_size == 1:
            self.runner.attend = _TimedLocalAttention(self.clock)
        else:
            self.runner.attend = _TimedTreeAttention(self.method, self.comm_group, self.clock)

    def _decode_step(self, tokens, positions):
        self.clock.start_step()
        slots = self.cache.extend(positions[:, None])
        store = self.cache.update(slots, slots.owned)
        attend = self.runner.attend
        before = dict(self.clock.current)
        start = time.perf_counter()
        hidden = self.model(tokens[:, None], positions[:, None], store, attend)
        forward = time.perf_counter() - start
        inside = sum(self.clock.current[p] - before[p] for p in ("attention", "combine"))
        self.clock.add("model", forward - inside)
        return hidden[:, -1]

    def _next_tokens(self, hidden, generator, **kwargs):
        result = super()._next_tokens(hidden, generator, **kwargs)
        self.clock.current = None  # the step ends here; later broadcasts (the log-probabilities) are not in it
        return result

    def _sample(self, hidden, generator):
        start = time.perf_counter()
        result = super()._sample(hidden, generator)
        self.clock.add("sampling", time.perf_counter() - start)
        return result

    def _broadcast(self, tensor, src):
        start = time.perf_counter()
        result = super()._broadcast(tensor, src)
        self.clock.add("broadcast", time.perf_counter() - start)
        return result

    def phase_means(self, warmup: int) -> dict[str, float]:
        """Mean seconds per decode step of each phase and of the whole step ("step"), over the
        decode steps after the first `warmup`."""
        steps = self.result.step_times_s
        records = self.clock.steps[len(self.clock.steps) - len(steps):]  # a reused cache's prefill records a step too
        kept = list(zip(records, steps))[warmup:] or list(zip(records, steps))
        means = {phase: sum(r[phase] for r, _ in kept) / len(kept) for phase in PHASES if phase != "host"}
        means["step"] = sum(s for _, s in kept) / len(kept)
        means["host"] = max(0.0, means["step"] - sum(means[p] for p in PHASES if p != "host"))
        return means


def build_model(name: str, seed: int):
    """The model of a ProfileSpec (the same weights on every rank)."""
    from treeattn.demo import DEMO_CONFIG
    from treeattn.models.llama import LlamaConfig, random_model

    if name == "demo":
        return random_model(LlamaConfig(**DEMO_CONFIG), seed=seed)
    if name == "smollm2-shapes":
        return random_model(LlamaConfig(**SMOLLM2_SHAPES), seed=seed)
    from treeattn.models.loader import load_model

    return load_model(name)


def variant_name(method: str, transport: str) -> str:
    """How a (method, transport) run is named in the reports: "onepass (shm)"."""
    return f"{method} ({transport})"


def profile_rank(rank: int, world_size: int, spec: ProfileSpec) -> dict:
    """One rank: prefill once, then decode with each method and transport from that cache. Returns, per variant_name,
    this rank's phase means, the generated ids and the decode rounds (comm_stats)."""
    from treeattn.demo import synthetic_prompt

    torch.set_num_threads(spec.threads)
    model = build_model(spec.model, spec.seed)
    prompt = synthetic_prompt(spec.context, model.config.vocab_size, spec.seed)
    group = dist.group.WORLD if world_size > 1 else None
    variants = [(method, transport) for method in spec.methods for transport in spec.transports]
    cache, runs = None, {variant_name(*v): [] for v in variants}
    for _ in range(spec.repeats):
        for method, transport in variants:
            run = ProfiledGeneration(model, [prompt], max_new_tokens=spec.new_tokens, stop_tokens=(), method=method,
                                     shared_memory=transport == "shm", cache=cache, group=group)
            for _ in run:
                pass
            cache = run.cache
            runs[variant_name(method, transport)].append(run)
    report = {}
    for method, done in runs.items():
        means = [run.phase_means(spec.warmup) for run in done]
        result = done[0].result
        report[method] = {"phases": {k: sum(m[k] for m in means) / len(means) for k in means[0]},
                          "generated_ids": result.generated_ids[0],
                          "same_ids_every_run": all(run.result.generated_ids == result.generated_ids for run in done),
                          "rounds_per_step": result.comm.get("rounds", 0) / max(1, result.decode_steps),
                          "runs": len(done)}
    if world_size > 1:
        dist.barrier()
    return report


def run_profile(spec: ProfileSpec, nproc: int) -> list[dict]:
    """profile_rank on `nproc` local ranks (in this process for 1). Returns every rank's report."""
    if nproc == 1:
        return [profile_rank(0, 1, spec)]
    from treeattn.parallel import spawn

    return spawn(profile_rank, nproc, spec, timeout=3600)
