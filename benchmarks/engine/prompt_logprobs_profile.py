"""Where prompt logprobs' scoring spends its CPU: the head's product against each reduction, per block and per pass.

    python3 benchmarks/engine/prompt_logprobs_profile.py SmolLM2.gguf --repeats 5 --rows 2048 --top 0

Random final hidden states (the speed does not depend on the values) and random targets, the head as score_rows
multiplies it (prepacked_head / dense_head: _Head.of). Three parts, each repeated and alternated:

- "parts", one torch thread, thread CPU time (time.thread_time_ns): one ROWS_PER_BLOCK block, a vocabulary chunk at a
  time as _ChunkReducer runs it, each call timed on its own: the targets' product, the chunk's product, amax, the
  count above the target, the exp-sum, the top k (torch's reductions), then the same product followed by the compiled
  pass (ops.logits_cpu_kernel.reduce_chunk).
- "block", the same thread and clock: the whole _score_block with torch's reductions (CHUNK_BYTES as it is) and with
  the compiled pass at each --chunk-mib CHUNK_BYTES, in an order rotated from repeat to repeat.
- "pass", torch on its default threads (chunk_pool splits the chunks): score_rows over --rows rows with torch's
  reductions and with the compiled pass (at each --chunk-mib CHUNK_BYTES), in an order rotated from repeat to
  repeat; wall and process CPU seconds, minor page faults, and each thread's CPU (harness.by_thread: a thread
  outside the pool that gains CPU is a BLAS or OpenMP worker).
- "pool products": the head's chunk products alone in chunk_pool's threads (no reduction): the same per-thread CPU.

Prints one JSON object (and writes it with --output): per part the seconds of each repeat and their medians, the
machine (CPU, load average) at the start and at the end, the command.
"""

from __future__ import annotations

import json
import resource
import statistics
import time

import torch

from treeattn.bench import harness
from treeattn.engine.worker import prompt_logprobs as pl


def _timed(spent: dict, name: str, fn, *args, **kwargs):
    start = time.thread_time_ns()
    out = fn(*args, **kwargs)
    spent[name] = spent.get(name, 0.0) + (time.thread_time_ns() - start) * 1e-9
    return out


def _block_parts(model, head, hidden, targets, top: int) -> dict:
    """One block's product and each torch reduction, chunk by chunk, then the compiled pass: thread CPU seconds."""
    spent, n, vocab = {}, hidden.shape[0], head.vocab
    columns = head.columns or pl.vocab_columns(n, vocab, threads=1)
    starts = list(range(0, vocab, columns))
    chosen = _timed(spent, "targets' product", lambda: model.logits(hidden, weight=head.target_rows(targets)).diagonal()
                    .contiguous())
    kernel = pl.reduction_kernel(hidden.device)
    table = torch.empty(3, len(starts), n)
    with torch.inference_mode():
        values, ids = torch.full((n, top), -float("inf")), torch.zeros(n, top, dtype=torch.int64)
        for j, first in enumerate(starts):
            vocab_slice = slice(first, first + columns)
            logits = _timed(spent, "product", head.logits, model, hidden, j, vocab_slice)
            scratch = torch.empty_like(logits)
            _timed(spent, "torch amax", torch.amax, logits, dim=-1, out=table[0, j])
            _timed(spent, "torch count", lambda: torch.sum(torch.gt(logits, chosen[:, None], out=scratch), dim=-1,
                                                            out=table[2, j]))
            _timed(spent, "torch exp-sum", lambda: torch.sum(torch.sub(logits, table[0, j][:, None], out=scratch)
                                                              .mul_(pl._LOG2_E).exp2_(), dim=-1, out=table[1, j]))
            if top:
                _timed(spent, "torch top k", torch.topk, logits, min(top, logits.shape[1]), dim=-1)
            logits = _timed(spent, "product (again)", head.logits, model, hidden, j, vocab_slice)
            _timed(spent, "compiled pass", kernel.reduce_chunk, logits.numpy(), chosen.numpy(), first,
                   table[0, j].numpy(), table[1, j].numpy(), table[2, j].numpy(), values.numpy(), ids.numpy())
    return spent


def _with_kernel(on: bool):
    kernel = pl.reduction_kernel
    pl.reduction_kernel = kernel if on else (lambda device: None)
    return kernel


def main() -> None:
    parser = harness.parser(__doc__, model="required", output=True, repeats=5)
    parser.add_argument("--rows", type=int, default=2048, help="rows of the pass (default 2048: four blocks)")
    parser.add_argument("--top", type=int, default=0, help="alternatives per row (the overhead benchmark's 0)")
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[4.0],
                        help="CHUNK_BYTES of the compiled pass's variants, MiB (torch's keeps the default)")
    args = harness.parse_args(parser)
    from treeattn.models.loader import load_model

    start_machine = harness.machine()
    model = load_model(args.model, weight_format="auto")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, model.config.hidden_size, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (args.rows,), generator=g)
    head = pl._Head.of(model)
    block, block_targets = hidden[: pl.ROWS_PER_BLOCK], targets[: pl.ROWS_PER_BLOCK]
    out = torch.empty(block.shape[0], 2 + 2 * args.top, dtype=torch.float64)
    threads = torch.get_num_threads()
    results = {"parts": {}, "block": {}, "pass": {}, "pool products": [], "pass threads": []}
    pl.score_rows(model, hidden[:600], targets[:600], args.top)  # the head's copy, the pool, the kernel: made once
    original, chunk_default = pl.reduction_kernel, pl.CHUNK_BYTES
    for r in range(args.repeats):
        torch.set_num_threads(1)
        variants = [("torch", False, chunk_default)] + [(f"compiled {mib} MiB", True, int(mib * 2**20))
                                                        for mib in args.chunk_mib]
        for name, on, chunk_bytes in variants[r % len(variants):] + variants[: r % len(variants)]:
            _with_kernel(on)
            pl.CHUNK_BYTES = chunk_bytes
            start = time.thread_time_ns()
            with torch.no_grad():
                pl._score_block(model, block, block_targets, args.top, out, head)
            results["block"].setdefault(name, []).append((time.thread_time_ns() - start) * 1e-9)
        pl.CHUNK_BYTES = chunk_default
        pl.reduction_kernel = original
        with torch.no_grad():
            for name, seconds in _block_parts(model, head, block, block_targets, args.top).items():
                results["parts"].setdefault(name, []).append(seconds)
        torch.set_num_threads(threads)
        for name, on, chunk_bytes in variants[r % len(variants):] + variants[: r % len(variants)]:
            _with_kernel(on)
            pl.CHUNK_BYTES = chunk_bytes
            before, wall, cpu = harness.thread_cpu(), time.perf_counter(), time.process_time()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            pl.score_rows(model, hidden, targets, args.top)
            entry = results["pass"].setdefault(name, {"wall_s": [], "cpu_s": [], "minor_faults": []})
            entry["wall_s"].append(time.perf_counter() - wall)
            entry["cpu_s"].append(time.process_time() - cpu)
            entry["minor_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            results["pass threads"].append({name: harness.by_thread(before, harness.thread_cpu())})
        pl.CHUNK_BYTES = chunk_default
        pl.reduction_kernel = original
        if threads > 1:
            columns = head.columns or pl.vocab_columns(block.shape[0], head.vocab, threads=1)
            before = harness.thread_cpu()
            with torch.no_grad():
                list(pl.chunk_pool(threads).map(lambda j: head.logits(model, block, j, slice(j * columns, (j + 1) * columns)),
                                                range(-(-head.vocab // columns))))
            results["pool products"].append(harness.by_thread(before, harness.thread_cpu()))
    summary = {part: {name: round(statistics.median(v), 4) for name, v in results[part].items()}
               for part in ("parts", "block")}
    summary["pass"] = {name: {kind: round(statistics.median(v), 3) for kind, v in runs.items()}
                       for name, runs in results["pass"].items()}
    report = {"model": args.model, "rows": args.rows, "top": args.top, "torch_threads": threads,
              "rows_per_block": pl.ROWS_PER_BLOCK, "medians": summary, "runs": results,
              "machine_start": start_machine, "machine_end": harness.machine(), "command": harness.command()}
    print(json.dumps(report, indent=1))
    harness.write_output(args.output, [report])


if __name__ == "__main__":
    main()
