"""`treeattn eval needle MODEL`: needle-in-a-haystack retrieval across ranks.

    treeattn eval needle model.gguf                                   # lengths sized for the window
    treeattn eval needle model.gguf --lengths 1024,4096 --depths 0,0.5,1 --nproc 4 --decode tree
    treeattn eval needle model.gguf --heatmap needle.png --json       # one JSON object on stdout
    treeattn eval needle model.gguf --nproc 2 --device cuda           # the ranks on cuda:0, cuda:1 (NCCL)

Progress and the table go to stderr (stdout with no --json); the exit status is 1 when the decode
methods disagree anywhere (they must not: attention is exact).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from treeattn.engine.config import DEFAULT_METHOD
from treeattn.engine.config import EngineConfig as E
from treeattn.engine.request import SamplingParams as S
from treeattn.commands.flags import (cli_message, config_flag, config_options, device_and_dtype, dtype_flag, model_argument,
                                     torch_dtype)

eval_app = typer.Typer(help="Evaluate a model through the engine.", no_args_is_help=True, rich_markup_mode=None)
stderr = Console(stderr=True)




def _numbers(text: str, kind, option: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"{option}: expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise ValueError(f"{option}: expected at least one value, got {text!r}")
    return values


NEEDLE_ENGINE_FLAGS = ("nproc", "decode", "method", "threads_per_rank", "device", "kv_cache_dtype", "weight_format")


@eval_app.command("needle")
@config_options(E, NEEDLE_ENGINE_FLAGS, into="engine", nproc={"help": "Local ranks; the KV cache is sharded across them."},
                decode={"help": "Decode attention whose answer is scored (on --nproc > 1; one rank decodes locally)."})
def needle_command(
    model: Path = model_argument(", with a tokenizer; its chat template renders the question when it has one (a base "
                                 "model such as Gemma 3 270M completes the document as plain text)."),
    lengths: str | None = typer.Option(None, "--lengths", help="Document lengths in tokens, comma-separated "
                                       "(default: 1024, 2048, ... up to the model's context window)."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle depths in [0, 1], comma-separated."),
    check_methods: bool = typer.Option(True, "--check-methods/--no-check-methods", help="Also answer with every other "
                                       "method (from the first one's prefill: the prefix cache serves the document again) and "
                                       "check that all give "
                                       "identical tokens."),
    max_new_tokens: int = config_flag(S, "max_new_tokens", default=16, min=1, help="Greedy tokens of each answer at most."),
    seed: int = config_flag(S, "seed", min=0, help="Filler order and hidden number."),
    heatmap_path: Path | None = typer.Option(None, "--heatmap", help="Write a heatmap PNG (matplotlib) here."),
    allow_beyond_context: bool = typer.Option(False, "--allow-beyond-context", help="Allow prompts longer than the model's "
                                              "context window (positions it never saw in training)."),
    dtype: str = dtype_flag(),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    engine: dict | None = None,
) -> None:
    """Needle-in-a-haystack: hide a number in a long document, ask for it, score exact retrieval."""
    from treeattn.eval.needle import default_lengths, heatmap, run_needle
    from treeattn.models.loader import read_config
    from treeattn.parallel import SpawnError

    try:
        nproc = engine["nproc"]
        kind, dtype = device_and_dtype(engine["device"], dtype, nproc)  # "cpu" or "cuda"; --dtype auto: bfloat16 on CUDA
        config = E(**{**engine, "decode": engine["decode"] if nproc > 1 else "local",
                      "method": engine["method"] or DEFAULT_METHOD,
                      "dtype": torch_dtype(dtype), "device": kind})  # --decode local on --nproc 2: one line
        depth_list = _numbers(depths, float, "--depths")
        if not all(0 <= d <= 1 for d in depth_list):
            raise ValueError(f"--depths: every depth must be in [0, 1], got {depths!r}")
        length_list = _numbers(lengths, int,
                               "--lengths") if lengths else default_lengths(read_config(model).max_position_embeddings)
        if not all(n >= 16 for n in length_list):
            raise ValueError(f"--lengths: every length must be at least 16 tokens, got {lengths!r}")
        start = time.perf_counter()
        if not json_output:
            stderr.print(f"needle eval of {model}: lengths {length_list}, depths {depth_list}, {nproc} rank(s), "
                         f"decode {config.decode}, {dtype} on {kind}")
        with stderr.status(f"{len(length_list) * len(depth_list)} prompts ...") if not json_output else _nothing():
            report = run_needle(str(model), config, S(max_new_tokens=max_new_tokens), lengths=length_list, depths=depth_list,
                                check_methods=check_methods, seed=seed, allow_beyond_context=allow_beyond_context)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    except SpawnError as exc:  # a rank failed: one line, then every rank's error
        typer.echo(f"error: {exc.summary}", err=True)
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    if heatmap_path is not None:
        heatmap(report, heatmap_path)
    if json_output:
        typer.echo(json.dumps(report.as_dict()))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(_table(report))
        agree = "identical tokens from every method" if report.methods_agree else "[red]decode methods DISAGREE[/red]"
        stderr.print(f"retrieved {sum(c.correct for c in report.cells)}/{len(report.cells)} ({report.accuracy:.0%}); "
                     f"methods: {', '.join(report.methods)}: {agree}; load {report.load_s:.1f} s, "
                     f"total {time.perf_counter() - start:.1f} s" + (f"; heatmap {heatmap_path}" if heatmap_path else ""))
    if not report.methods_agree:
        raise typer.Exit(1)


def _table(report) -> Table:
    lengths = sorted({c.length for c in report.cells})
    depths = sorted({c.depth for c in report.cells})
    by_cell = {(c.length, c.depth): c for c in report.cells}
    table = Table(title=f"needle retrieval ({report.nproc} rank(s), {report.decode}): answer found / methods agree")
    table.add_column("depth")
    for n in lengths:
        table.add_column(f"{n} tok", justify="center")
    for d in depths:
        cells = [by_cell[(n, d)] for n in lengths]
        table.add_row(f"{d:.0%}",
                      *(("yes" if c.correct else "no") + (" / same" if c.methods_agree else " / DIFF") for c in cells))
    return table


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


from treeattn.eval.ruler_cli import RulerCommand, ruler_command  # noqa: E402

eval_app.command("ruler", cls=RulerCommand)(ruler_command)

__all__ = ["eval_app", "needle_command", "ruler_command"]
