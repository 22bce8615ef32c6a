"""The `treeattn` command line (also `python -m treeattn`).

Each subcommand lives in the module of its layer and is registered here, so this file stays a
table of contents.
"""

from __future__ import annotations

import logging

import typer

app = typer.Typer(
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


def _register_simulate() -> None:
    from treeattn.sim.cli import simulate

    app.command(name="simulate")(simulate)


_register_simulate()


def _register_bench() -> None:
    from treeattn.bench.cli import bench_app

    app.add_typer(bench_app, name="bench")


_register_bench()


def _register_engine() -> None:
    from treeattn.engine_cli import demo_command, generate_command

    app.command(name="generate")(generate_command)
    app.command(name="demo")(demo_command)


_register_engine()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
