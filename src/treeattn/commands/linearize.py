"""`treeattn linearize`: train Hedgehog maps for chosen layers of a checkpoint (attention transfer)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from treeattn.commands.flags import model_argument


def _layers(text: str, num_layers: int) -> list[int]:
    """"1,3,5" -> [1, 3, 5]; "odd", "even", "every:4" (0, 4, 8, ...) or "every:4+1" (1, 5, 9, ...)."""
    if text in ("odd", "even"):
        return list(range(1 if text == "odd" else 0, num_layers, 2))
    if text.startswith("every:"):
        step, _, offset = text.removeprefix("every:").partition("+")
        return list(range(int(offset or 0), num_layers, int(step)))
    return [int(part) for part in text.split(",") if part.strip()]


def linearize_command(
    model: Path = model_argument(),
    layers: str = typer.Option(..., "--layers", help='Layers to linearize: "1,3,5", "odd", "even", "every:4" or "every:4+1".'),
    text: Path = typer.Option(..., "--text", help="UTF-8 text file to train on (tokenized with the model's tokenizer)."),
    tokens: int = typer.Option(1024, "--tokens", min=1, help="Training tokens (the first N of the text)."),
    out: Path = typer.Option(..., "--out", help="Directory for feature_maps.safetensors and linear_layers.json."),
    seq_len: int = typer.Option(256, "--seq-len", min=2, help="Tokens per training sequence."),
    feature_dim: int | None = typer.Option(None, "--feature-dim", min=1, help="Hedgehog features per map (default: head dim)."),
    steps: int = typer.Option(40, "--steps", min=1, help="Adam steps per layer."),
    lr: float = typer.Option(1e-2, "--lr", min=0.0, help="Adam learning rate."),
    batch: int = typer.Option(4, "--batch", min=1, help="Sequences per step."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's)."),
) -> None:
    """Train the Hedgehog feature maps of --layers on CPU so that each layer's linear attention
    reproduces its softmax attention output on --text (no other weight changes); save them to --out."""
    import torch

    from treeattn.linear.hybrid import save_feature_maps
    from treeattn.linear.linearize import linearize
    from treeattn.models import load_model

    if threads:
        torch.set_num_threads(threads)
    if not text.is_file():
        raise typer.BadParameter(f"--text {text}: no such file")
    net = load_model(model)
    if net.tokenizer is None:
        raise typer.BadParameter(f"MODEL {model}: the checkpoint has no tokenizer, --text cannot be tokenized")
    try:
        chosen = _layers(layers, net.config.num_layers)
    except ValueError:
        raise typer.BadParameter(f'--layers must be "1,3,5", "odd", "even" or "every:K[+OFFSET]", got {layers!r}') from None
    ids = net.tokenizer.encode(text.read_text(encoding="utf-8")).ids
    if len(ids) < min(tokens, seq_len):
        raise typer.BadParameter(f"--text has {len(ids)} tokens, fewer than --seq-len {seq_len}")
    try:
        report = linearize(net, chosen, ids, seq_len=seq_len, num_tokens=tokens, feature_dim=feature_dim, steps=steps, lr=lr,
                           batch=batch, log=lambda line: typer.echo(line, err=True))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    save_feature_maps(net, out, checkpoint=str(model), tokens=tokens, seq_len=seq_len, steps=steps, lr=lr,
                      loss_before=report.loss_before, loss_after=report.loss_after)
    typer.echo(json.dumps({"out": str(out), "layers": report.layers, "loss_before": report.loss_before,
                           "loss_after": report.loss_after, "seconds": report.seconds}))
