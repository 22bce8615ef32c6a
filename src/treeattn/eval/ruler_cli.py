"""`treeattn eval ruler MODEL`: RULER's synthetic tasks on 1, 2, 4 ... ranks, the outputs compared.

    treeattn eval ruler model.gguf --context 4096 --samples 4 --nproc 1 2 4
    treeattn eval ruler model.gguf --context 4096,8192 --tasks niah_single,vt --nproc 1 --nproc 2 --json

--context and --nproc take several values in any of three spellings, mixed freely: space-separated
after one flag (`--nproc 1 2 4`), comma-separated (`--nproc 1,2,4`) or the flag repeated
(`--nproc 1 --nproc 2 --nproc 4`). Click options take one value each, so the command's class
(RulerCommand) joins the integers that follow such a flag into its comma list before click parses.

The table (score per task and context for each rank count, and seconds per sample) goes to stderr
(stdout without --json); the exit status is 1 when a sample's greedy tokens differ between rank
counts (they must not: attention is exact).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand

from treeattn.engine.config import DEFAULT_METHOD
from treeattn.engine.config import EngineConfig as E
from treeattn.commands.flags import cli_message, config_options

stderr = Console(stderr=True)


_INTS = re.compile(r"[0-9][0-9,]*")
MULTI_VALUE_OPTIONS = ("--context", "--nproc")


def join_values(args: list[str], options=MULTI_VALUE_OPTIONS) -> list[str]:
    """The command line with the integers that follow one of `options`' values joined to it by commas.

    >>> join_values(["m.gguf", "--nproc", "1", "2", "4", "--context", "4096", "8192", "--samples", "2"])
    ['m.gguf', '--nproc', '1,2,4', '--context', '4096,8192', '--samples', '2']
    >>> join_values(["--nproc=1", "2", "m.gguf", "--samples", "3", "4"])  # --samples takes one: 4 stays
    ['--nproc=1,2', 'm.gguf', '--samples', '3', '4']
    """
    out: list[str] = []
    open_ = False  # the last word was a value of one of `options`
    for i, word in enumerate(args):
        if word == "--":
            return out + args[i:]
        if open_ and _INTS.fullmatch(word):
            out[-1] += "," + word
            continue
        name, eq, value = word.partition("=")
        open_ = bool(_INTS.fullmatch(word) and out and out[-1] in options) or bool(
            eq and name in options and _INTS.fullmatch(value)
        )
        out.append(word)
    return out


class RulerCommand(TyperCommand):
    """`--nproc 1 2 4`: the words after --context / --nproc that are integers are that option's values."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, join_values(list(args)))


def _ints(values: list[str], option: str) -> list[int]:
    try:
        out = [int(x) for v in values for x in v.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"{option}: expected integers (space- or comma-separated), got {values!r}") from exc
    if not out or any(n < 1 for n in out):
        raise ValueError(f"{option}: expected integers >= 1, got {values!r}")
    return out


@config_options(E, ("method", "threads_per_rank"), into="engine")
def ruler_command(
    model: Path = typer.Argument(..., help="Hugging Face model directory or .gguf file with a tokenizer."),
    context: list[str] = typer.Option(["4096"], "--context", metavar="N [N...]",
                                      help="Context lengths in tokens (space- or comma-separated, or repeated)."),
    tasks: str = typer.Option(",".join(("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")),
                              "--tasks", metavar="TASK[,TASK...]", help="RULER tasks, comma-separated."),
    samples: int = typer.Option(4, "--samples", min=1, help="Samples per task and context."),
    nproc: list[str] = typer.Option(["1", "2"], "--nproc", metavar="P [P...]",
                                    help="Rank counts to run and compare (space- or comma-separated, or repeated)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the generated samples."),
    output: Path | None = typer.Option(None, "--output", help="Also write the JSON report (every sample) here."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else."),
    engine: dict = None,
) -> None:
    """RULER (NIAH single/multi-key/multi-value/multi-query, variable tracking, common words) per rank count."""
    method, threads = engine["method"], engine["threads_per_rank"]
    from treeattn.eval.ruler import run_ruler
    from treeattn.eval.ruler_tasks import TASKS
    from treeattn.models.loader import read_config
    from treeattn.parallel import SpawnError

    start = time.perf_counter()
    try:
        contexts, nprocs = _ints(context, "--context"), _ints(nproc, "--nproc")
        task_list = [t.strip() for t in tasks.split(",") if t.strip()]
        unknown = [t for t in task_list if t not in TASKS]
        if unknown or not task_list:
            raise ValueError(f"--tasks: expected some of {', '.join(TASKS)}, got {tasks!r}")
        window = read_config(model).max_position_embeddings
        if max(contexts) > window:
            raise ValueError(f"--context: {max(contexts)} is beyond the model's context window of {window}")
        if not json_output:
            stderr.print(f"RULER on {model}: tasks {task_list}, contexts {contexts}, {samples} sample(s) each, ranks {nprocs}")

        def done(p: int, partial) -> None:  # the report so far goes to --output after each rank count
            if output is not None:
                output.write_text(json.dumps(partial.as_dict(), indent=1))
            if not json_output:
                stderr.print(f"  {p} rank(s) done ({time.perf_counter() - start:.0f} s)")

        report = run_ruler(str(model), tasks=task_list, contexts=contexts, samples=samples, nprocs=nprocs,
                           method=method or DEFAULT_METHOD, seed=seed, threads=threads, on_done=done)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {cli_message(exc)}", err=True)
        raise typer.Exit(2) from exc
    except SpawnError as exc:
        typer.echo(f"error: {exc.summary}", err=True)
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    raw = report.as_dict()
    if output is not None:
        output.write_text(json.dumps(raw, indent=1))
    if json_output:
        typer.echo(json.dumps(raw))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(_table(report))
        bad = report.mismatches()
        stderr.print(f"{len(report.results) // len(nprocs)} samples on each of {nprocs} rank(s): "
                     + ("identical greedy tokens on every rank count" if not bad else f"[red]{len(bad)} sample(s) DIFFER[/red]")
                     + f"; total {time.perf_counter() - start:.0f} s")
    if report.mismatches():
        raise typer.Exit(1)


def _table(report) -> Table:
    scores, seconds = report.scores(), report.seconds_per_sample()
    nprocs = sorted({p for p, _, _ in scores})
    table = Table(title="RULER score (string_match_all, %) / seconds per sample")
    table.add_column("task")
    table.add_column("context", justify="right")
    for p in nprocs:
        table.add_column(f"{p} rank(s)", justify="right")
    for task, context in sorted({(t, c) for _, t, c in scores}, key=lambda tc: (tc[1], tc[0])):
        table.add_row(task, str(context), *(f"{100 * scores[(p, task, context)]:.0f} / {seconds[(p, task, context)]:.1f} s"
                                            for p in nprocs))
    return table


__all__ = ["MULTI_VALUE_OPTIONS", "RulerCommand", "join_values", "ruler_command"]
