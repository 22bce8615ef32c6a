"""One rank's decode step in thread CPU time: the compiled kernels' calls against everything around them.

    python3 benchmarks/engine/step_cpu_profile.py MODEL --context 4096 --steps 24 --mode plain kernels cprofile

A ta.Engine of one rank in this process (its step runs in this thread), one torch thread, the weights packed,
--activation-format and --kv-cache-dtype as given, prefills a synthetic prompt of --context tokens and decodes
greedily. Every decode step after the first --warmup is timed in this thread's CPU time (time.thread_time_ns:
other processes' load does not count, a loaded machine's cache and memory contention does). Modes, each a run
of its own:

    plain     the step's CPU time, nothing else instrumented
    kernels   also the CPU time inside each compiled kernel's Python entry (packed matmul, split into the
              LM head and the layers' projections; the paged attention kernel; RMSNorm and RoPE; where the checkout
              has them, the compiled decode segments whole, "segments": treeattn.ops.decode_layer_cpu), the numba
              dispatch of its arguments included; "around" is the step less the kernels (each timed call adds
              its own two clock reads, about a microsecond, to the figures)
    parts     the step's own time (exclusive) in the decode layer's parts: the model's modules (norms, attention, MLP,
              layers), the packed products, RoPE, the batch's kv_store and attend, the kernels, each wrapped in a
              timer (two clock reads a call, about 0.7 us, counted in the caller)
    cprofile  cProfile with a thread-CPU timer over the timed steps: the functions by own time (its overhead
              inflates Python-heavy code; read it for where, not how much)

Prints one JSON line per mode (ms a step: median and mean, calls per step) and, for cprofile, the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

KERNELS = (("treeattn.ops.packed_cpu_kernel", "matmul", "packed"), ("treeattn.ops.packed_int8_kernel", "matmul", "packed"),
           ("treeattn.ops.paged_cpu_kernel", "attend", "paged"), ("treeattn.ops.rowwise_cpu_kernel", "rms_norm", "rms_norm"),
           ("treeattn.ops.rowwise_cpu_kernel", "rope", "rope"), ("treeattn.ops.rowwise_cpu_kernel", "rope_pair", "rope"),
           ("treeattn.ops.decode_layer_cpu", "attention_input", "segments"),
           ("treeattn.ops.decode_layer_cpu", "mlp_input", "segments"),
           ("treeattn.ops.decode_layer_cpu", "mlp_output", "segments"),
           ("treeattn.ops.decode_layer_cpu", "final_output", "segments"),
           ("treeattn.ops.decode_layer_cpu", "gemma_attention_input", "segments"),
           ("treeattn.ops.decode_layer_cpu", "gemma_mlp_input", "segments"),
           ("treeattn.ops.decode_layer_cpu", "gemma_mlp_output", "segments"),
           ("treeattn.ops.decode_layer_cpu", "gemma_final_output", "segments"),
           ("treeattn.ops.decode_layer_cpu", "window_store", "segments"))
"""The kernels' Python entries; "segments" (treeattn.ops.decode_layer_cpu, where the checkout has it: the compiled decode
segments; Gemma 3's gemma_* and its window rings' window_store) are the packed products, norms, RoPE, residual adds and
cache writes between two attention calls, as one call."""


def _module(name: str):
    """treeattn's module `name`, or None where this checkout has none (an older one timed against a newer)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _instrument(spent: dict, calls: dict, vocab: int):
    """Wrap each kernel entry of KERNELS to add its thread CPU ns to spent[name]; returns an undo()."""

    undo = []
    depth = [0]  # only the outermost kernel entry counts (the paged kernel's Python entry calls its compiled one)
    entries = KERNELS + (("treeattn.ops.paged_cpu_kernel", "attend_serial", "paged"),
                         ("treeattn.ops.paged_cpu_kernel", "attend_parallel", "paged"))
    for module_name, attr, name in entries:
        module = _module(module_name)
        if module is None or not hasattr(module, attr):  # (rope_pair, the segments: not in older checkouts)
            continue
        original = getattr(module, attr)

        def timed(*args, _original=original, _name=name, **kwargs):
            depth[0] += 1
            start = time.thread_time_ns()
            try:
                _original(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0]:
                return
            key = "lm_head" if _name == "packed" and args[-1].shape[-1] == vocab else _name
            spent[key] = spent.get(key, 0) + time.thread_time_ns() - start
            calls[key] = calls.get(key, 0) + 1

        setattr(module, attr, timed)
        undo.append((module, attr, original))

    def restore():
        for module, attr, original in undo:
            setattr(module, attr, original)

    return restore


PARTS = (("treeattn.models.llama", "RMSNorm", "forward", "norm"),
         ("treeattn.models.gemma3", "Gemma3RMSNorm", "forward", "norm"),
         ("treeattn.models.llama", "Attention", "forward", "attention module"),
         ("treeattn.models.llama", "Attention", "queries_keys", "rope (queries_keys)"),
         ("treeattn.models.gemma3", "Gemma3Attention", "queries_keys", "rope (queries_keys)"),
         ("treeattn.models.llama", "MLP", "forward", "mlp module"),
         ("treeattn.models.gemma3", "Gemma3MLP", "forward", "mlp module"),
         ("treeattn.models.llama", "DecoderLayer", "forward", "layer"),
         ("treeattn.models.gemma3", "Gemma3DecoderLayer", "forward", "layer"),
         ("treeattn.models.packed", "FusedPacked", "__call__", "fused product"),
         ("treeattn.models.packed", "PackedLinear", "forward", "packed linear"),
         ("treeattn.engine.worker.batch", "PagedBatch", "kv_store", "kv_store"),
         ("treeattn.engine.worker.batch", "PagedBatch", "attend", "batch.attend"),
         ("treeattn.engine.worker.runner", "RankRunner", "_outcome", "sampling"),
         ("treeattn.models.llama", "LlamaModel", "forward", "model"),
         ("treeattn.models.gemma3", "Gemma3Model", "forward", "model"),
         ("treeattn.engine.worker.batch", "PagedBatch", "__init__", "batch setup"),
         ("treeattn.engine.worker.compiled_decode", "CompiledDecode", "forward", "compiled decode"),
         ("treeattn.engine.worker.compiled_decode", "CompiledDecode", "_attend", "compiled attention"))


class _Item:
    """A dict entry as an attribute (setattr(_Item(d, key), "value", x) sets d[key]), for the undo list."""

    def __init__(self, mapping: dict, key) -> None:
        self.__dict__["mapping"], self.__dict__["key"] = mapping, key

    def __setattr__(self, name: str, value) -> None:
        self.mapping[self.key] = value


def _instrument_parts(spent: dict, calls: dict):
    """Exclusive thread CPU ns per part of PARTS and per kernel of KERNELS (a stack of open timers); returns an undo()."""
    import importlib

    stack = []  # [start, children's ns]
    undo = []

    def wrap(owner, attr, name):
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            stack.append([time.thread_time_ns(), 0])
            try:
                return original(*args, **kwargs)
            finally:
                start, children = stack.pop()
                elapsed = time.thread_time_ns() - start
                spent[name] = spent.get(name, 0) + elapsed - children
                calls[name] = calls.get(name, 0) + 1
                if stack:
                    stack[-1][1] += elapsed

        setattr(owner, attr, timed)
        undo.append((owner, attr, original))

    for module_name, cls, attr, name in PARTS:
        owner = getattr(_module(module_name), cls, None)
        if owner is not None and attr in owner.__dict__:
            wrap(owner, attr, name)
    for module_name, attr, name in KERNELS:
        if hasattr(module := _module(module_name), attr):  # (rope_pair, the segments: not in older checkouts)
            wrap(module, attr, "kernel " + name)
    # the compiled entries themselves too (a caller may hold them: ops.packed_linear.serial_matmul,
    # paged_cpu_kernel.entry); nested in the Python entries above where those run, which the stack accounts for
    for module_name in ("treeattn.ops.packed_cpu_kernel", "treeattn.ops.packed_int8_kernel"):
        kernels = importlib.import_module(module_name)._KERNELS
        for fmt in list(kernels):
            wrapped = []
            for i in range(len(kernels[fmt])):
                holder = type("Holder", (), {"f": staticmethod(kernels[fmt][i])})
                wrap(holder, "f", "kernel packed")
                wrapped.append(holder.f)
            original = kernels[fmt]
            kernels[fmt] = tuple(wrapped)
            undo.append((_Item(kernels, fmt), "value", original))
    paged = importlib.import_module("treeattn.ops.paged_cpu_kernel")
    for attr in ("attend_serial", "attend_parallel"):
        wrap(paged, attr, "kernel paged")

    def restore():
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)

    return restore


def _barrier(path: str, count: int, timeout_s: float = 1800.0) -> None:
    """Wait until `count` processes reached this point (a file each under `path`), so that alternated runs started
    side by side time their steps at the same time, under the same load."""
    import os

    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, str(os.getpid())), "w").close()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(path)) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def run(args, mode: str) -> dict:
    from treeattn.engine.client import Engine
    from treeattn.engine.worker.runner import RankRunner
    from treeattn.models.loader import load_model
    from treeattn.models.synthetic import synthetic_prompt

    model = load_model(args.model, weight_format="packed", with_tokenizer=False)
    prompt = synthetic_prompt(args.context, model.config.vocab_size, 0)
    steps, spent, calls = [], {}, {}
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9) if mode == "cprofile" else None
    original_step = RankRunner.step
    decode = [0]

    def step(self, plan):
        timed = bool(plan.chunks) and all(c.decoding for c in plan.chunks)
        if timed:
            decode[0] += 1
            if decode[0] == args.warmup + 1:
                spent.clear()
                calls.clear()
        on = timed and decode[0] > args.warmup
        if on and decode[0] == args.warmup + 1 and args.barrier:  # run the timed steps beside the other process's
            _barrier(args.barrier, args.barrier_count)
        if on and profiler is not None:
            profiler.enable()
        start = time.thread_time_ns()
        out = original_step(self, plan)
        elapsed = time.thread_time_ns() - start
        if on and profiler is not None:
            profiler.disable()
        if on:
            steps.append(elapsed)
        return out

    RankRunner.step = step
    _module("treeattn.ops.decode_layer_cpu")  # imported before the kernels are wrapped: it binds the real rms_norm
    restore = (_instrument(spent, calls, model.config.vocab_size) if mode == "kernels" else
               _instrument_parts(spent, calls) if mode == "parts" else (lambda: None))
    positions = len(prompt) + args.steps + args.warmup + 2
    try:
        with Engine(model, decode="local", device="cpu", max_batch_size=1, prefix_cache=False, block_size=256,
                    cache_tokens=positions + 256, max_context=positions, kv_cache_dtype=args.kv_cache_dtype,
                    activation_format=args.activation_format) as engine:
            result, = engine.generate([prompt], max_new_tokens=args.steps + args.warmup + 1, ignore_eos=True)
    finally:
        RankRunner.step = original_step
        restore()
    n = len(steps)
    ordered = sorted(steps)
    row = {"mode": mode, "steps": n, "step_ms_median": statistics.median(steps) / 1e6, "step_ms_mean": sum(steps) / n / 1e6,
           "step_ms_min": ordered[0] / 1e6, "step_ms_p25": ordered[n // 4] / 1e6,
           "token_ids": result.token_ids, "load": open("/proc/loadavg").read().split()[:3]}
    if mode == "parts":
        row["exclusive_ms"] = {k: round(v / n / 1e6, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
        row["calls_per_step"] = {k: v / n for k, v in sorted(calls.items())}
        row["outside_parts_ms"] = row["step_ms_mean"] - sum(spent.values()) / n / 1e6
    if mode == "kernels":
        row["kernel_ms"] = {k: v / n / 1e6 for k, v in sorted(spent.items())}
        row["calls_per_step"] = {k: v / n for k, v in sorted(calls.items())}
        row["around_ms"] = row["step_ms_mean"] - sum(row["kernel_ms"].values())
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
        row["cprofile"] = text.getvalue()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before the timed ones")
    p.add_argument("--mode", nargs="+", default=["plain"], choices=["plain", "kernels", "parts", "cprofile"])
    p.add_argument("--activation-format", default="int8")
    p.add_argument("--kv-cache-dtype", default="float16")
    p.add_argument("--top", type=int, default=45, help="functions cprofile prints")
    p.add_argument("--barrier", default=None, help="a folder: wait there for --barrier-count processes before the timed steps")
    p.add_argument("--barrier-count", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    for mode in args.mode:
        row = run(args, mode)
        text = row.pop("cprofile", None)
        print(json.dumps(row), flush=True)
        if text:
            print(text, flush=True)


if __name__ == "__main__":
    main()
