"""The `treeattn` command line (also `python -m treeattn`).

    treeattn generate MODEL --prompt "..." --nproc 4       # treeattn.commands.generate
    treeattn chat MODEL --nproc 2                          # treeattn.commands.chat
    treeattn serve MODEL --nproc 2 --port 8000             # treeattn.serve.cli
    treeattn demo [MODEL] [--synthetic]                    # treeattn.eval.demo_cli
    treeattn models [--path NAME]                          # treeattn.eval.models_cli: the installed models
    treeattn eval needle MODEL | bench ... | simulate ...  # eval/, bench/, sim/

Each subcommand lives in the module of its layer and is listed here, so this file stays a
table of contents. A subcommand's module is imported only when that subcommand runs (or --help
lists them all): `treeattn generate` never imports bench/, sim/ or matplotlib.

One vocabulary: a concept has one flag in every command (--nproc for the number of ranks,
--max-new-tokens, --max-context, --dtype float32|bfloat16|float16, --json for one JSON object on
stdout, the model as the first positional argument); the engine's flags come from the fields of
its configuration (treeattn.commands.flags). Spellings of earlier releases still work: ALIASES
rewrites them before the command parses its arguments, and the help does not list them. A usage
error is one line on stderr, `error: ...`, with exit status 2.
"""

from __future__ import annotations

import importlib
import logging
import sys

import typer
from typer.core import TyperGroup

# name -> (module, attribute): a typer command function or a typer.Typer sub-application.
LAZY_COMMANDS = {
    "generate": ("treeattn.commands.generate", "generate_command"),
    "chat": ("treeattn.commands.chat", "chat_command"),
    "demo": ("treeattn.eval.demo_cli", "demo_command"),
    "models": ("treeattn.eval.models_cli", "models_command"),
    "simulate": ("treeattn.sim.cli", "simulate"),
    "bench": ("treeattn.bench.cli", "bench_app"),
    "eval": ("treeattn.eval.cli", "eval_app"),
    "serve": ("treeattn.serve.cli", "serve_command"),
    "linearize": ("treeattn.commands.linearize", "linearize_command"),
}


# command -> {old spelling: today's flag}: hidden aliases (an old spelling of a positional argument maps to "").
ALIASES = {
    "generate": {"--capacity": "--max-context", "--no-stop": "--ignore-eos"},
    "demo": {"--new-tokens": "--max-new-tokens", "--model": ""},
    "simulate": {"--gpus": "--nproc", "-p": "--nproc", "--new-tokens": "--max-new-tokens"},
    "bench": {"--world-size": "--nproc", "-p": "--nproc", "--new-tokens": "--max-new-tokens", "--json": "--output",
              "--threads-per-rank": "--threads", "--out": "--plot"},
}


# flag -> a value that meant "the default" and is no choice today: the flag and value are dropped.
DEFAULT_VALUES = {"--speculate": "none"}


def rewrite_aliases(args: list[str]) -> list[str]:
    """`args` (the command's name first) with old spellings of flags replaced by today's."""
    args = list(args)
    for flag, value in DEFAULT_VALUES.items():
        while f"{flag}={value}" in args:
            args.remove(f"{flag}={value}")
        for i in range(len(args) - 2, -1, -1):
            if args[i] == flag and args[i + 1] == value:
                del args[i:i + 2]
    if not args or args[0] not in ALIASES:
        return args
    table, out = ALIASES[args[0]], [args[0]]
    for arg in args[1:]:
        name, eq, value = arg.partition("=")
        if name in table:
            new = table[name]
            if new:
                out.append(new + eq + value)
            elif eq:
                out.append(value)
            continue
        out.append(arg)
    return out


class _LazyGroup(TyperGroup):
    """The root command: LAZY_COMMANDS are imported when first looked up (click's lazy-loading
    pattern); old flag spellings are rewritten (ALIASES); usage errors are one `error:` line."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, rewrite_aliases(args))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        try:
            status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            if not standalone_mode:
                raise
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        except typer.TyperException as exc:  # click's ClickException (typer vendors click): a usage error
            if not standalone_mode:
                raise
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            typer.echo(f"error: {' '.join(message.split())}", err=True)
            sys.exit(getattr(exc, "exit_code", 2))
        if standalone_mode:
            sys.exit(status if isinstance(status, int) else 0)
        return status

    def list_commands(self, ctx) -> list[str]:
        return sorted(super().list_commands(ctx) + list(LAZY_COMMANDS))

    def get_command(self, ctx, name: str):
        if name not in LAZY_COMMANDS:
            return super().get_command(ctx, name)
        module, attribute = LAZY_COMMANDS[name]
        target = getattr(importlib.import_module(module), attribute)
        holder = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
        if isinstance(target, typer.Typer):
            holder.add_typer(target, name=name)
        else:
            holder.command(name=name)(target)
        command = typer.main.get_command(holder)
        return command.commands[name] if isinstance(command, TyperGroup) else command


app = typer.Typer(
    cls=_LazyGroup,
    name="treeattn",
    help="Exact attention for decoding from sequence-sharded long-context KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level to stderr.")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def version() -> None:
    """Print the treeattn version."""
    import treeattn

    typer.echo(treeattn.__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
