"""The `treeattn` command line (also `python -m treeattn`).

Each subcommand lives in the module of its layer and is listed here, so this file stays a
table of contents. A subcommand's module is imported only when that subcommand runs (or --help
lists them all): `treeattn generate` never imports bench/, sim/ or matplotlib.
"""

from __future__ import annotations

import importlib
import logging

import typer
from typer.core import TyperGroup

# name -> (module, attribute): a typer command function or a typer.Typer sub-application.
LAZY_COMMANDS = {
    "generate": ("treeattn.engine_cli", "generate_command"),
    "demo": ("treeattn.engine_cli", "demo_command"),
    "simulate": ("treeattn.sim.cli", "simulate"),
    "bench": ("treeattn.bench.cli", "bench_app"),
    "eval": ("treeattn.eval.cli", "eval_app"),
    "serve": ("treeattn.serve.cli", "serve_command"),
    "linearize": ("treeattn.linear.cli", "linearize_command"),
}


class _LazyGroup(TyperGroup):
    """The root command: LAZY_COMMANDS are imported when first looked up (click's lazy-loading pattern)."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(super().list_commands(ctx) + list(LAZY_COMMANDS))

    def get_command(self, ctx, name: str):
        if name not in LAZY_COMMANDS:
            return super().get_command(ctx, name)
        module, attribute = LAZY_COMMANDS[name]
        target = getattr(importlib.import_module(module), attribute)
        holder = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
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
