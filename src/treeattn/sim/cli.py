"""`treeattn simulate`: the cost model from the command line."""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import typer

from treeattn.commands.flags import dtype_flag
from treeattn.sim.hardware import CALIBRATED_PRESET, CLUSTER_FLAGS, PRESET_NAMES, Cluster, cluster_overrides, load_cluster
from treeattn.sim.helix import (
    COMBINES,
    ELEMENT_BYTES,
    LAYOUTS,
    MODELS,
    Layout,
    ModelShape,
    helix_tp_choices,
    predict_step,
    shape_from_config,
)
from treeattn.sim.model import METHODS, check_method, memory_shortfall, predict_decode, predict_generation
from treeattn.sim.workload import DecodeShape


def _option_group(into: str, options: list[tuple[str, object, object]], build=dict):
    """Decorator: the command's parameter `into` becomes one keyword-only parameter per (name, type,
    typer.Option or typer.Argument) of `options`, at its place; the command receives build(name -> value)."""
    def decorate(command):
        signature = inspect.signature(command)
        params = list(signature.parameters.values())
        at = [p.name for p in params].index(into)
        group = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind, default=default)
                 for name, kind, default in options]
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[at + 1:]]

        @functools.wraps(command)
        def run(*args, **kwargs):
            values = {name: kwargs.pop(name) for name, _, _ in options}
            return command(*args, **kwargs, **{into: build(values)})

        run.__signature__ = signature.replace(parameters=params[:at] + group + rest)
        run.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != into},
                               **{name: kind for name, kind, _ in options}}
        return run

    return decorate


def cluster_options(into: str):
    """Decorator: the command takes one flag per CLUSTER_FLAGS entry (--mem-bw-gbs, ..., in the flag's
    unit; default None: the preset's value), in place of its parameter `into`, which receives them as
    Cluster.with_overrides keywords in SI units (cluster_overrides).

        >>> @cluster_options(into="overrides")
        ... def command(preset: str = "dgx-h100", overrides: dict = None):
        ...     return {k: v for k, v in overrides.items() if v is not None}
        >>> list(inspect.signature(command).parameters)[:3]
        ['preset', 'gpus_per_node', 'mem_bw_gbs']
        >>> command(**{f.name: None for f in CLUSTER_FLAGS} | {"mem_bw_gbs": 2000.0, "gpus_per_node": 4})
        {'gpus_per_node': 4, 'memory_bandwidth': 2000000000000.0}
    """
    options = [(f.name, f.kind | None, typer.Option(None, help=f.help)) for f in CLUSTER_FLAGS]
    return _option_group(into, options, cluster_overrides)


MODEL_HELP = ("Price a whole model's decode step in a 2-D layout (N = KV ranks x TP ranks) instead of one attention "
              "layer: " + ", ".join(MODELS) + ", or a Llama-family checkpoint directory or .gguf file (its config).")


def model_options(into: str):
    """Decorator: the command takes the MODEL mode's argument and flags (MODEL, --tp, --layout, --weight-dtype,
    --kv-cache-dtype) in place of its parameter `into`, which receives them as one dict (name -> value).

        >>> @model_options(into="model")
        ... def command(model: dict = None):
        ...     return model
        >>> list(inspect.signature(command).parameters)
        ['model', 'tp', 'layout', 'weight_dtype', 'kv_cache_dtype']
        >>> command(model="deepseek-r1", tp=[8], layout=None, weight_dtype="fp4", kv_cache_dtype="fp8")["tp"]
        [8]
    """
    options = [
        ("model", str | None, typer.Argument(None, help=MODEL_HELP)),
        ("tp", list[int] | None, typer.Option(None, "--tp", help="With MODEL: attention TP width(s) T of the helix and medha "
                                              "layouts (the sequence is split N / T ways; default: every T that divides N and "
                                              "the KV heads).")),
        ("layout", list[str] | None, typer.Option(None, help="With MODEL: layout(s) " + ", ".join(LAYOUTS) + " (default: all).")),
        ("weight_dtype", str, typer.Option("fp4", help="With MODEL: weight storage, " + ", ".join(ELEMENT_BYTES) + ".")),
        ("kv_cache_dtype", str, typer.Option("fp4", help="With MODEL: KV cache storage, " + ", ".join(ELEMENT_BYTES) + ".")),
    ]
    return _option_group(into, options)


def _cluster_from_options(preset: str, calibration: Path | None, overrides: dict[str, float | int | None]) -> Cluster:
    if calibration is not None and preset != CALIBRATED_PRESET:
        raise ValueError("--calibration only applies to --preset cpu-local")
    cluster = load_cluster(preset, calibration)
    return cluster.with_overrides(**overrides)


@model_options(into="model_flags")
@cluster_options(into="overrides")
def simulate(
    preset: str = typer.Option("dgx-h100", help=f"Cluster preset: {', '.join(PRESET_NAMES)}."),
    calibration: Path | None = typer.Option(None, help="Calibration JSON for --preset cpu-local (default ./calibration.json)."),
    gpus: list[int] = typer.Option([8], "--nproc",
                                   help="World size(s) p: ranks (devices) sharing the KV cache; repeat for several."),
    seq_len: list[int] = typer.Option([5_120_000], "--seq-len", "-n", help="KV cache length(s) N; repeat for several."),
    heads: int = typer.Option(16, help="Query heads Hq."),
    kv_heads: int | None = typer.Option(None, help="KV heads Hkv (default: Hq)."),
    head_dim: int = typer.Option(128, help="Head dim D (= Dv)."),
    batch: int = typer.Option(1, help="Batch size B."),
    dtype: str = dtype_flag("bfloat16", help="Storage dtype of q, k, v."),
    method: list[str] | None = typer.Option(None, "--method", "-m", help="Method(s): " + ", ".join(METHODS) + " (default: all); "
                                            "with MODEL, how the KV ranks combine: alltoall (Helix's, default) or onepass."),
    model_flags: dict | None = None,
    overrides: dict | None = None,
    new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="Also estimate prefill + this many decode steps."),
    layers: int = typer.Option(1, help="Attention layers, for --max-new-tokens."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line per configuration."),
    plot: Path | None = typer.Option(None, help="Write latency/speedup/memory/comm PNGs into this folder."),
    plot_prefix: str = typer.Option("", help="File name prefix of the PNGs (default sim_<preset>)."),
    show_preset: bool = typer.Option(False,
                                     help="Print the cluster parameters and their sources, then exit (--json: raw values)."),
    paper: bool = typer.Option(False, help="Print the comparison with the paper's reported figures (Markdown), then exit."),
) -> None:
    """Predict one decode step (or prefill + n decode steps) of every method on a two-level cluster."""
    if paper:
        from treeattn.sim import helix_paper
        from treeattn.sim.paper import markdown_report

        typer.echo(markdown_report())
        typer.echo("\n" + helix_paper.markdown_report())
        return
    model = model_flags["model"]
    try:
        cluster = _cluster_from_options(preset, calibration, overrides)
        if model is not None:
            options = ModelOptions(model, model_flags["tp"], model_flags["layout"], model_flags["weight_dtype"],
                                   model_flags["kv_cache_dtype"], method)
            records = _predict_model(cluster, options, gpus, seq_len, batch, dtype)
    except (ValueError, TypeError) as err:
        raise _usage_error(err) from None
    if model is not None:
        _print_model_records(records, cluster.name, as_json)
        return
    method = list(METHODS) if method is None else method
    try:
        for m in method:
            check_method(m)
        shapes = [
            DecodeShape(seq_len=n, heads=heads, head_dim=head_dim, batch=batch, kv_heads=kv_heads, dtype=dtype)
            for n in seq_len
        ]
        for p in gpus:
            cluster.nodes(p)
    except (ValueError, TypeError) as err:
        raise _usage_error(err) from None

    if show_preset:
        if as_json:  # the raw values (SI units: bytes, seconds), as Cluster.from_dict reads them
            typer.echo(json.dumps(cluster.to_dict(), indent=2))
        else:
            _print_preset(cluster)
        return

    try:
        records, shortfalls = _predict(cluster, shapes, gpus, method, new_tokens, layers)
    except (ValueError, TypeError) as err:
        raise _usage_error(err) from None

    if as_json:
        for record in records:
            typer.echo(json.dumps(record))
    else:
        _print_table(records, cluster.name, new_tokens is not None)
    for line in shortfalls:
        typer.echo(f"does not fit in memory: {line}", err=True)
    if plot is not None:
        title = f"cost model, {cluster.name}, Hq={heads} D={head_dim} B={batch} {shapes[0].dtype}"
        _write_figures(records, plot, plot_prefix or f"sim_{cluster.name}", title)


@dataclass(frozen=True)
class ModelOptions:
    """The MODEL mode's options as given on the command line (None: the default)."""

    model: str
    tp: list[int] | None
    layouts: list[str] | None
    weight_dtype: str
    kv_cache_dtype: str
    combine: list[str] | None


def _predict_model(cluster: Cluster, options: ModelOptions, nprocs: list[int], seq_lens: list[int], batch: int,
                   activation_dtype: str) -> list[dict]:
    """One record per (world size, layout, tp, sequence length, combine): StepPrediction.as_dict()
    plus `preset`. Every argument is checked before the first prediction."""
    shape = _model_shape(options.model)
    layouts = options.layouts or list(LAYOUTS)
    for kind in layouts:
        if kind not in LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, got {kind!r}")
    combines = options.combine or ["alltoall"]
    for c in combines:
        if c not in COMBINES:
            raise ValueError(f"--method with MODEL must be one of {', '.join(COMBINES)}, got {c!r}")
    configs = []
    for n in nprocs:
        cluster.nodes(n)
        for kind in layouts:
            tps = (options.tp or helix_tp_choices(shape, n)) if kind in ("helix", "medha") else [1]
            for t in tps:
                layout = Layout.of(kind, n, tp=t)
                if shape.heads % layout.tp != 0:
                    what = f"--tp {t}" if kind in ("helix", "medha") else f"--layout {kind} on --nproc {n} (tp {layout.tp})"
                    raise ValueError(f"{what} must divide {shape.name}'s {shape.heads} query heads")
                configs += [(layout, c) for c in (combines if kind == "helix" else combines[:1])]
    records = []
    for layout, combine in configs:
        for n_tokens in seq_lens:
            p = predict_step(cluster, shape, layout, n_tokens, batch=batch, weight_dtype=options.weight_dtype,
                             kv_dtype=options.kv_cache_dtype, activation_dtype=activation_dtype, combine=combine)
            records.append({**p.as_dict(), "preset": cluster.name})
    return records


def _model_shape(model: str) -> ModelShape:
    """A MODELS name, or the config of a checkpoint directory / .gguf file."""
    if model in MODELS:
        return MODELS[model]
    from pathlib import Path

    if not Path(model).exists():
        raise ValueError(f"MODEL must be one of {', '.join(MODELS)} or a checkpoint directory or .gguf file, got {model!r}")
    from treeattn.models import read_config

    return shape_from_config(read_config(model), Path(model).name)


def _print_model_records(records: list[dict], preset: str, as_json: bool) -> None:
    if as_json:
        for record in records:
            typer.echo(json.dumps(record))
        return
    from rich.console import Console
    from rich.table import Table

    from treeattn.sim.units import format_bytes, format_memory, format_seconds

    table = Table(title=f"predicted decode step of {records[0]['model']} (every layer), preset {preset}")
    columns = ("layout", "N", "tp", "kv", "seq_len", "batch", "time/token", "attention", "other kernels", "comm",
               "sent", "weights/rank", "KV/rank")
    for col in columns:
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in records:
        fits = "" if r["fits_memory"] is not False else " !"
        name = r["layout"] + (f" ({r['combine']})" if r["layout"] == "helix" and r["kv"] > 1 else "")
        table.add_row(name, str(r["nproc"]), str(r["tp"]), str(r["kv"]), f"{r['seq_len']:,}", str(r["batch"]),
                      format_seconds(r["predicted_seconds"]), format_seconds(r["attention_seconds"]),
                      format_seconds(r["weights_seconds"]), format_seconds(r["comm_seconds"]), format_bytes(r["comm_bytes"]),
                      format_memory(r["weight_bytes_per_rank"]) + fits, format_memory(r["kv_bytes_per_rank"]) + fits)
    Console(width=180).print(table)
    if any(r["fits_memory"] is False for r in records):
        Console(width=180).print("! weights + KV cache do not fit in one device's memory")


def _usage_error(err: Exception) -> typer.Exit:
    """Print `err` as the command's one `error:` line; the exit (status 2, a usage error) to raise."""
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(2)


def _predict(cluster: Cluster, shapes: list[DecodeShape], nprocs: list[int], methods: list[str],
             new_tokens: int | None, layers: int) -> tuple[list[dict], list[str]]:
    """One record per (world size, shape, method), in that nesting order, and a line per
    configuration whose K/V cache does not fit in the cluster's memory.

    Each record is `Prediction.as_dict()` plus `preset`; with `new_tokens`, also `new_tokens`,
    `layers`, `prefill_seconds` and `generation_seconds` (prefill + new_tokens decode steps)."""
    records: list[dict] = []
    shortfalls: list[str] = []
    for p in nprocs:
        for shape in shapes:
            for m in methods:
                prediction = predict_decode(cluster, shape, p, m)
                if (shortfall := memory_shortfall(cluster, prediction)) is not None:
                    shortfalls.append(shortfall)
                record = prediction.as_dict()
                record["preset"] = cluster.name
                if new_tokens is not None:
                    gen = predict_generation(cluster, shape, p, m, new_tokens, layers)
                    record.update(
                        new_tokens=new_tokens,
                        layers=layers,
                        prefill_seconds=gen.prefill_seconds,
                        generation_seconds=gen.predicted_seconds,
                    )
                records.append(record)
    return records, shortfalls


def _write_figures(records: list[dict], folder: Path, prefix: str, title: str) -> None:
    """The latency/speedup/memory/comm PNGs of the predictions in `folder`; their paths on stderr."""
    from treeattn.sim.plots import make_figures

    for path in make_figures(records, folder, prefix, "predicted_seconds", title):
        typer.echo(f"wrote {path}", err=True)


def _print_table(records: list[dict], preset: str, generation: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from treeattn.sim.units import format_bytes, format_memory, format_seconds

    table = Table(title=f"predicted decode step, preset {preset}")
    for col in ("method", "gpus", "seq_len", "latency", "speedup vs ring-kv", "sent (busiest rank)", "rounds", "steps",
                "peak memory"):
        table.add_column(col, justify="right" if col != "method" else "left")
    if generation:
        table.add_column("prefill + decode", justify="right")
    ring = {(r["gpus"], r["seq_len"]): r["predicted_seconds"] for r in records if r["method"] == "ring-kv"}
    for r in records:
        base = ring.get((r["gpus"], r["seq_len"]))
        row = [
            r["method"],
            str(r["gpus"]),
            f"{r['seq_len']:,}",
            format_seconds(r["predicted_seconds"]),
            f"{base / r['predicted_seconds']:.3g}x" if base else "-",
            format_bytes(r["bytes"]),
            str(r["rounds"]),
            str(r["steps"]),
            format_memory(r["peak_memory_bytes"]) + (" !" if r.get("fits_memory") is False else ""),
        ]
        if generation:
            row.append(format_seconds(r["generation_seconds"]))
        table.add_row(*row)
    Console(width=160).print(table)
    if any(r.get("fits_memory") is False for r in records):
        Console(width=160).print("! the K/V cache does not fit in the devices' memory (see below)")


def preset_rows(cluster) -> list[tuple[str, str, str]]:
    """(parameter, readable value, source) of every parameter of `cluster`, in its field order
    (links as latency and bandwidth rows)."""
    from dataclasses import fields

    from treeattn.sim.units import format_flops, format_memory, format_rate, format_seconds

    def readable(name: str, value) -> str:
        if value is None:
            return "-"
        if name.endswith("bandwidth"):
            return format_rate(value)
        if name.endswith(("efficiency", "overlap")):
            return f"{value * 100:.3g} %"
        if name == "peak_flops":
            return format_flops(value)
        if name == "memory_capacity":
            return format_memory(value)
        if name.endswith(("overhead", "seconds", "latency")):
            return format_seconds(value)
        if name.startswith("busy_"):
            return ", ".join(f"p={p}: {format_seconds(t)}" for p, t in value) or "-"
        return str(value)

    rows = []
    for f in fields(cluster):
        if f.name == "sources":
            continue
        value = getattr(cluster, f.name)
        if f.name in ("intra", "inter"):
            for part in ("latency", "bandwidth"):
                key = f"{f.name}.{part}"
                rows.append((key, readable(key, getattr(value, part)), cluster.sources.get(key, "")))
        else:
            rows.append((f.name, readable(f.name, value), cluster.sources.get(f.name, "")))
    return rows


def _print_preset(cluster) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"preset {cluster.name}")
    for col in ("parameter", "value", "source"):
        table.add_column(col, justify="right" if col == "value" else "left", overflow="fold")
    for row in preset_rows(cluster):
        table.add_row(*row)
    Console(width=160).print(table)
