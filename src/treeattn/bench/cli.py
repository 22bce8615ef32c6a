"""`treeattn bench ...`: decode benchmark sweeps, calibration, and the cost-model validation."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import typer

from treeattn.engine.config import EngineConfig
from treeattn.commands.flags import DTYPE_ALIASES, config_options, dtype_flag

from treeattn.bench.config import METHODS, SweepConfig

SHORT_DTYPES = {name: short for short, name in DTYPE_ALIASES.items() if short != "half"}
"""--dtype's names (float32, ...) -> the sweep records' (fp32, ...)."""

PROFILE_ENGINE_FLAGS = ("threads_per_rank", "device", "kv_cache_dtype", "weight_format", "activation_format")
"""The EngineConfig fields `bench profile` takes as flags (commands.flags.config_options), one value each; --nproc and
--method are sweeps (lists of values), --max-new-tokens counts its warm-up steps: its own options."""

bench_app = typer.Typer(help="Benchmarks: decode sweeps, calibration, cost-model validation, serving load.", no_args_is_help=True,
                        rich_markup_mode=None)


def _refuse(message: str) -> typer.Exit:
    """Print one line, `error: <message>`, on stderr; the caller raises the returned Exit(2)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _parse_topology(text: str) -> tuple[int, int]:
    """'NODESxRANKS' -> (nodes, ranks_per_node)."""
    try:
        nodes, ranks = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise _refuse(f"--topology: expected NODESxRANKS_PER_NODE like 2x2, got {text!r}") from None
    if nodes < 2 or ranks < 1:
        raise _refuse(f"--topology: need >= 2 nodes and >= 1 rank per node, got {text!r}")
    return nodes, ranks


def _check_outputs(files: list[tuple[str, Path | None, tuple[str, ...]]], folders: list[tuple[str, Path | None]] = ()) -> None:
    """Refuse, before running, output files (option, path, suffixes) and folders (option, path)
    that could not be written afterwards."""
    from treeattn.bench.runner import check_output_folder, check_output_path

    try:
        for option, path, suffixes in files:
            if path is not None:
                check_output_path(path, option, suffixes)
        for option, path in folders:
            if path is not None:
                check_output_folder(path, option)
    except ValueError as err:
        raise _refuse(str(err)) from None


class SweepInterrupted(Exception):
    """Ctrl-C during a sweep; `records` holds the cases finished (or failed) before it."""

    def __init__(self, records: list[dict]) -> None:
        super().__init__(f"interrupted after {len(records)} cases")
        self.records = records


def run_with_progress(config: SweepConfig, launcher=None) -> list[dict]:
    """run_decode_sweep with a rich progress bar over the cases (follows the records file).
    Ctrl-C raises SweepInterrupted with the records so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from treeattn.bench.runner import run_decode_sweep

    total = len(config.world_sizes) * len(config.seq_lens) * len(config.methods)
    tmp = tempfile.mkdtemp(prefix="treeattn-bench-")
    try:
        records_path = Path(tmp) / "records.jsonl"
        records_path.touch()
        outcome: dict = {}

        def work() -> None:
            try:
                outcome["records"] = run_decode_sweep(config, records_path, launcher)
            except BaseException as err:  # noqa: BLE001 -- re-raised in the main thread
                outcome["error"] = err

        def finished() -> list[dict]:
            return [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]

        thread = threading.Thread(target=work, daemon=True)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("decode sweep", total=total)
            thread.start()
            try:
                while thread.is_alive():
                    thread.join(0.3)
                    done = finished()
                    if done:
                        last = done[-1]
                        progress.update(task, completed=len(done),
                                        description=f"{last['method']} p={last['gpus']} N={last['seq_len']}")
            except KeyboardInterrupt:  # the ranks end with this process (ta.spawn ties them to it)
                raise SweepInterrupted(finished()) from None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["records"]
    finally:
        _remove_folder(tmp)


def _remove_folder(path: str, attempts: int = 50) -> None:
    """shutil.rmtree that outlasts the sweep's thread appending one more record while the folder goes (after
    Ctrl-C or SIGTERM the thread still runs: TemporaryDirectory's cleanup then failed with "Directory not
    empty", and the interrupted sweep exited 1 instead of 130, leaving the folder)."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.1)


def _run_sweep(config: SweepConfig, nodes: int | None, spec, ranks_per_node: int | None) -> list[dict]:
    """The sweep on local processes, or with --topology in network namespaces."""
    if nodes is None:
        return run_with_progress(config)
    from treeattn.bench.netns import NetnsUnavailable, two_tier_network

    try:
        with two_tier_network(spec) as net:
            return run_with_progress(config, net.launcher(ranks_per_node))
    except NetnsUnavailable as err:
        typer.echo(f"--topology needs Linux network namespaces, which are not available here: {err}", err=True)
        raise typer.Exit(0) from None


@contextlib.contextmanager
def _term_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP act as Ctrl-C while the sweep runs (main thread only): the finished
    cases are written and the temporary records folder removed; the ranks end with this process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) not in (signal.SIG_IGN, None):
            previous[signum] = signal.signal(signum, signal.default_int_handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _print_records(records: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decode step, slowest rank (barrier-aligned)")
    for col in ("method", "p", "seq_len", "median ms", "p10 ms", "p90 ms", "bytes sent (max rank)", "rounds",
                "peak MiB (max rank)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    failed = [r for r in records if "error" in r]
    if failed:
        table.add_column("error", justify="left")
    for r in records:
        if "error" in r:
            table.add_row(r["method"], str(r["gpus"]), str(r["seq_len"]), *["-"] * 6, r["error"])
            continue
        peak = r.get("peak_memory_bytes")
        table.add_row(
            r["method"], str(r["gpus"]), str(r["seq_len"]),
            f"{r['median_seconds'] * 1e3:.3f}", f"{r['p10_seconds'] * 1e3:.3f}", f"{r['p90_seconds'] * 1e3:.3f}",
            f"{r['bytes']:.0f}", str(r["rounds"]), "-" if peak is None else f"{peak / 2**20:.1f}", *([""] if failed else []),
        )
    Console(width=160).print(table)


def _print_per_rank(records: list[dict]) -> None:
    """Bytes each rank sent per op, and what left each node's interface: which ranks talk across
    nodes."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bytes sent per rank and op in one step (comm_stats), and per node interface")
    for col in ("method", "p", "seq_len", "rank", "node", "allreduce", "broadcast", "allgather", "p2p", "node tx bytes/step"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in records:
        if "error" in r:
            continue
        per_node = r.get("ranks_per_node") or r["gpus"]
        for rank, ops in enumerate(r["by_op_per_rank"]):
            tx = r["interface_tx_bytes_per_step"][rank]
            table.add_row(
                r["method"], str(r["gpus"]), str(r["seq_len"]), str(rank), str(rank // per_node),
                *(f"{ops[op]['bytes_sent']:.0f}" for op in ("allreduce", "broadcast", "allgather", "p2p")),
                "-" if tx is None else f"{tx:.0f}",
            )
    Console(width=160).print(table)


@bench_app.command("decode")
def decode(
    method: list[str] = typer.Option(["allreduce", "tree", "ring-kv", "ring-q"], "--method", "-m",
                                     help="Methods: " + ", ".join(METHODS)),
    world_size: list[int] = typer.Option([2], "--nproc", help="Ranks; repeat for several."),
    seq_len: list[int] = typer.Option([16384], "--seq-len", "-n", help="KV cache length(s)."),
    heads: int = typer.Option(16, help="Query heads Hq."),
    kv_heads: int | None = typer.Option(None, help="KV heads Hkv (default Hq)."),
    head_dim: int = typer.Option(128, help="Head dim D."),
    batch: int = typer.Option(1, help="Batch B."),
    dtype: str = dtype_flag(default="float32", help="q, k, v dtype."),
    warmup: int = typer.Option(2, help="Untimed calls per case."),
    repeats: int = typer.Option(10, help="Timed calls per case."),
    threads_per_rank: int = typer.Option(1, "--threads", min=1, help="torch threads in each rank."),
    backend: str = typer.Option("gloo", help="gloo (CPU) or nccl (GPU)."),
    ranks_per_node: int | None = typer.Option(None, help="Ranks per node for twolevel (must divide every world size)."),
    topology: str | None = typer.Option(None, help="NODESxRANKS: run in that many network namespaces (needs root + iproute2)."),
    inter_mbit: float | None = typer.Option(None, help="With --topology: inter-node bandwidth, Mbit/s per node and direction."),
    inter_delay_ms: float = typer.Option(0.0, help="With --topology: inter-node one-way delay, ms (needs tc netem)."),
    output: list[Path] = typer.Option([], "--output", "-o", help="Write records: .json or .csv (repeatable)."),
    plot: Path | None = typer.Option(None, help="Write latency/speedup/memory/comm PNGs into this folder."),
    plot_prefix: str = typer.Option("bench", help="File name prefix of the PNGs."),
    timeout: float = typer.Option(300.0,
                                  help="Seconds a collective may block, or a rank show no sign of life, before the case fails."),
    per_rank: bool = typer.Option(False, help="Also print bytes per rank and op (always with --topology)."),
) -> None:
    """Time decode methods on real process groups: median, p10, p90 of the slowest rank.

    A case that fails (a rank raised, died or stopped answering) is a row with its error; the
    other cases still run, every record is written, and the command exits 1."""
    from treeattn.bench.runner import check_resources, write_records

    nodes = None
    if topology is not None:
        nodes, per_node = _parse_topology(topology)
        if ranks_per_node is not None and ranks_per_node != per_node:
            raise _refuse(f"--ranks-per-node {ranks_per_node} contradicts --topology {topology}")
        ranks_per_node = per_node
        if world_size == [2]:
            world_size = [nodes * per_node]
    elif inter_mbit is not None or inter_delay_ms:
        raise _refuse("--inter-mbit and --inter-delay-ms need --topology")
    try:
        config = SweepConfig(
            methods=tuple(method), world_sizes=tuple(world_size), seq_lens=tuple(seq_len), heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, batch=batch, dtype=SHORT_DTYPES[dtype], warmup=warmup, repeats=repeats,
                             ranks_per_node=ranks_per_node,
            threads_per_rank=threads_per_rank, backend=backend, timeout=timeout,
        )
        if nodes is not None:
            from treeattn.bench.netns import NetworkSpec

            spec = NetworkSpec(nodes=nodes, inter_mbit=inter_mbit, inter_delay_ms=inter_delay_ms)
            for p in config.world_sizes:
                if p > nodes * ranks_per_node:
                    raise ValueError(f"world size {p} does not fit on topology {topology} ({nodes * ranks_per_node} ranks)")
        check_resources(config)
    except ValueError as err:
        raise _refuse(str(err)) from None
    _check_outputs([("--output", path, (".json", ".csv")) for path in output], [("--plot", plot)])

    interrupted = False
    try:
        with _term_as_interrupt():
            records = _run_sweep(config, nodes, spec if nodes is not None else None, ranks_per_node)
    except SweepInterrupted as stop:
        records, interrupted = stop.records, True
        typer.echo(f"interrupted: keeping the {len(records)} cases done so far", err=True)
    for r in records:
        if nodes is not None:
            r.update(topology=topology, inter_mbit=inter_mbit, inter_delay_ms=inter_delay_ms)
    _print_records(records)
    if per_rank or nodes is not None:
        _print_per_rank(records)
    for path in output:
        write_records(records, path)
        typer.echo(f"wrote {path}", err=True)
    if interrupted:
        raise typer.Exit(130)
    failed = [r for r in records if "error" in r]
    if plot is not None and len(failed) < len(records):
        from treeattn.sim.plots import make_figures

        title = f"measured, gloo CPU, Hq={heads} D={head_dim} B={batch} {dtype}" + (f", {topology}" if topology else "")
        for path in make_figures(records, plot, plot_prefix, "median_seconds", title):
            typer.echo(f"wrote {path}", err=True)
    if failed:
        first = failed[0]
        typer.echo(f"{len(failed)} of {len(records)} cases failed; first: {first['method']} p={first['gpus']} "
                   f"N={first['seq_len']}: {first['error']}", err=True)
        raise typer.Exit(1)


@bench_app.command("calibrate")
def calibrate_command(
    output: Path = typer.Option(Path("calibration.json"), "--output", "-o", help="Where to write the calibration JSON."),
    repeats: int = typer.Option(5, help="Repetitions of each measurement (the median is kept)."),
    passes: int = typer.Option(1, help="Whole calibrations, 10 s apart; each figure keeps its fastest pass."),
    world_size: list[int] = typer.Option([2, 4], "--nproc",
                                         help="World sizes at which the busy-round costs (p2p step, small collective among "
                                              "computing ranks) are measured."),
) -> None:
    """Measure gloo loopback latency/bandwidth, 1-thread attention rate, merge cost, memory bandwidth,
    and the cost of a p2p step / small collective among busy ranks at each world size."""
    from treeattn.bench.calibrate import write_calibration

    _check_outputs([("--output", output, (".json",))])
    start = time.perf_counter()
    try:
        result = write_calibration(output, repeats, passes, tuple(world_size))
    except ValueError as err:
        raise _refuse(str(err)) from None
    c = result["cluster"]
    m = result["measurements"]
    typer.echo(
        f"p2p latency {c['intra']['latency'] * 1e6:.1f} us + call {c['collective_overhead'] * 1e6:.1f} us, "
        f"ping-pong {m['p2p_large_bytes'] / m['p2p_large_one_way_seconds'] / 1e9:.2f} GB/s, attention "
        f"{c['memory_bandwidth'] / 1e9:.2f} GB/s per rank "
        f"(+{c['kernel_overhead'] * 1e3:.2f} ms/call), {c['host_memory_bandwidth'] / 1e9:.2f} GB/s with all cores, "
        f"merge {c['merge_seconds'] * 1e6:.1f} us, ring-step transfer {c['intra']['bandwidth'] / 1e9:.2f} GB/s, "
        f"copy {m['copy_bandwidth_1_thread'] / 1e9:.1f} GB/s (1 thread)"
    )
    for p, compute, p2p, allreduce in zip(m["busy_world_sizes"], m["busy_compute_seconds"], m["busy_p2p_seconds"],
                                          m["busy_allreduce_seconds"]):
        typer.echo(
            f"p={p} busy ranks: attention {compute * 1e3:.2f} ms, + ring step {(p2p - compute) * 1e3:+.2f} ms, "
            f"+ allreduce {(allreduce - compute) * 1e3:+.2f} ms"
        )
    for (p, p2p), (_, collective) in zip(c["busy_round_p2p"], c["busy_round_collective"]):
        typer.echo(f"busy-round term at p={p}: {p2p * 1e3:.2f} ms per p2p step, {collective * 1e3:.2f} ms per collective call")
    for (p, p2p), (_, collective) in zip(c["busy_next_round_p2p"], c["busy_next_round_collective"]):
        typer.echo(f"back-to-back round term at p={p}: {p2p * 1e3:.2f} ms per further p2p step, {collective * 1e3:.2f} ms per "
                   f"further collective call")
    typer.echo(f"wrote {output} in {time.perf_counter() - start:.0f} s", err=True)


@bench_app.command("validate")
def validate_command(
    calibration: Path = typer.Option(Path("calibration.json"), help="Calibration JSON from `treeattn bench calibrate`."),
    method: list[str] = typer.Option(["allreduce", "tree", "ring-kv", "ring-q"], "--method", "-m",
                                     help="Method(s) to benchmark and predict; repeat for several."),
    world_size: list[int] = typer.Option([2, 4], "--nproc", help="Ranks; repeat for several."),
    seq_len: list[int] = typer.Option([16384, 65536, 262144], "--seq-len", "-n",
                                      help="KV cache length(s) N; repeat for several."),
    warmup: int = typer.Option(1, help="Untimed calls per case."),
    repeats: int = typer.Option(5, help="Timed calls per case."),
    tolerance: float = typer.Option(0.35, help="Allowed |predicted - measured| / measured."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write measured + predicted records as JSON."),
    markdown: Path | None = typer.Option(None, help="Write the validation table as Markdown."),
    records: Path | None = typer.Option(None,
                                        help="Compare these saved benchmark records (a --output JSON of validate or bench "
                                             "decode) instead of running."),
    passes: int = typer.Option(1,
                               help="Run the whole sweep this many times and keep, per case, the pass with the lowest median."),
    calibrate_each_pass: bool = typer.Option(False,
                                             help="Calibrate right before every pass and predict each pass's cases from its own "
                                                  "calibration (--calibration is then ignored)."),
) -> None:
    """Benchmark tree and ring decoding here (Hq=16, D=128, fp32, B=1) and compare with the
    cost model's cpu-local predictions; exits 1 if any point misses the tolerance.

    On a shared machine other tenants' bursts can slow a whole case; with --passes k the sweep
    runs k times (minutes apart) and each case keeps its least disturbed pass."""
    from treeattn.bench.validate import best_of_passes, compare, markdown_table
    from treeattn.sim.hardware import load_cluster

    from treeattn.bench.runner import check_resources

    if passes < 1:
        raise _refuse(f"--passes must be >= 1, got {passes}")
    _check_outputs([("--output", output, (".json",)), ("--markdown", markdown, (".md",))])
    try:
        cluster = None if calibrate_each_pass else load_cluster("cpu-local", calibration)
        config = SweepConfig(methods=tuple(method), world_sizes=tuple(world_size), seq_lens=tuple(seq_len), heads=16,
                             head_dim=128,
                             batch=1, dtype="fp32", warmup=warmup, repeats=repeats, timeout=600.0)
        if records is None:
            check_resources(config)
    except ValueError as err:
        raise _refuse(str(err)) from None
    if records is None:
        runs = []
        for i in range(passes):
            pass_cluster = None
            if calibrate_each_pass:
                from treeattn.bench.calibrate import calibrate

                pass_cluster = calibrate(repeats=5, world_sizes=tuple(sorted(set(world_size) | {2})))["cluster"]
                typer.echo(f"pass {i + 1}: calibrated", err=True)
            run = run_with_progress(config)
            for r in run:
                r["pass"] = i
                if pass_cluster is not None:
                    r["calibration_cluster"] = pass_cluster
            runs.append(run)
        measured = best_of_passes(runs)
    else:
        measured = _load_records(records, "--records")
    rows = compare(measured, cluster)
    table = markdown_table(rows, tolerance)
    typer.echo(table)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        source = "calibrated before each pass" if calibrate_each_pass else str(calibration)
        output.write_text(json.dumps({"calibration": source, "rows": rows, "records": measured}, indent=1))
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(table + "\n")
    misses = [r for r in rows if abs(r["error"]) > tolerance]
    failed = [r for r in measured if "error" in r]
    for r in failed:
        typer.echo(f"failed: {r['method']} p={r['gpus']} N={r['seq_len']}: {r['error']}", err=True)
    if misses:
        typer.echo(f"{len(misses)} of {len(rows)} points miss the {tolerance:.0%} tolerance", err=True)
    if misses or failed:
        raise typer.Exit(1)


@bench_app.command("plot")
def plot_command(
    records: Path = typer.Argument(..., help="Records JSON from `bench decode --output` or `bench validate --output`."),
    out: Path = typer.Option(Path("docs/figures"), "--plot",
                             help="Folder for the PNGs (as `simulate --plot` and `bench decode --plot`)."),
    prefix: str = typer.Option("bench", help="File name prefix."),
    title: str = typer.Option("measured, gloo CPU ranks", help="Figure title."),
) -> None:
    """Draw the latency/speedup/memory/comm figures of saved benchmark records."""
    from treeattn.sim.plots import make_figures

    rows = _load_records(records, "RECORDS")
    _check_outputs([], [("--plot", out)])
    try:
        paths = make_figures(rows, out, prefix, "median_seconds", title)
    except ValueError as err:
        raise _refuse(f"{records}: {err}") from None
    for path in paths:
        typer.echo(f"wrote {path}", err=True)


@bench_app.command("profile")
@config_options(EngineConfig, PROFILE_ENGINE_FLAGS, into="engine",
                threads_per_rank={"help": "torch threads per rank (default cores / ranks, at least 1)."},
                device={"help": "Where the ranks run: auto (CUDA when torch sees a GPU), cpu or cuda (rank r on cuda:r, an NCCL "
                                "group)."})
def profile_command(
    model: str = typer.Argument(..., help="demo, smollm2-shapes (random weights, SmolLM2-135M's 30-layer shapes), "
                                "or a checkpoint: Hugging Face directory or .gguf file."),
    nproc: list[int] = typer.Option([1, 2, 4], "--nproc", help="World sizes (repeatable)."),
    context: int = typer.Option(8192, "--context", min=2, help="Synthetic prompt length in tokens."),
    new_tokens: int = typer.Option(16, "--max-new-tokens", min=4,
                                   help="Greedy tokens per method (the first --warmup steps are not counted)."),
    method: list[str] = typer.Option(["allreduce", "onepass"], "--method", "-m",
                                     help="tree_decode methods, each a prefill and a decode."),
    transport: list[str] = typer.Option(["shm"], "--transport", "-t", help="How the ranks combine (repeatable): shm (shared "
                                        "memory, the default of generate and the engine) or gloo (the process group's sockets); "
                                        "CUDA ranks: their NCCL group."),
    warmup: int = typer.Option(2, "--warmup", min=0, help="Decode steps left out of the means."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Run the methods in turn this many times (means over all runs)."),
    json_out: Path | None = typer.Option(None, "--output", "-o", help="Also write every rank's figures to this JSON file."),
    dtype: str = dtype_flag(),
    engine: dict = None,
) -> None:
    """Split one decode token's time on each rank: local attention, combine, sampling, rest of the model."""
    import os

    from rich.console import Console
    from rich.table import Table

    from treeattn.bench.profile import PHASES, ProfileSpec, run_profile, variant_name
    from treeattn.parallel.tree_decode import METHODS as TREE_METHODS

    from treeattn.engine.device import check_gpus, resolve_device
    from treeattn.engine.errors import ConfigError
    from treeattn.commands.flags import torch_dtype

    threads, weight_format, kv_cache_dtype = engine["threads_per_rank"], engine["weight_format"], engine["kv_cache_dtype"]
    activation_format = engine["activation_format"]
    try:
        kind = resolve_device(engine["device"])
        check_gpus(kind, max(nproc))
    except ConfigError as exc:
        from treeattn.commands.flags import cli_message

        raise _refuse(cli_message(exc)) from exc
    bad = [m for m in method if m not in TREE_METHODS]
    if bad:
        raise _refuse(f"--method: expected tree_decode methods {TREE_METHODS}, got {bad[0]!r}")
    bad = [t for t in transport if t not in ("shm", "gloo")]
    if bad:
        raise _refuse(f"--transport: expected shm or gloo, got {bad[0]!r}")
    if kind == "cuda":  # CUDA ranks combine over their NCCL group; shared memory is for CPU tensors
        transport = ["nccl"]
    if new_tokens <= warmup:
        raise _refuse(f"--max-new-tokens {new_tokens} leaves no step after --warmup {warmup}")
    _check_outputs([("--output", json_out, (".json",))])
    table = Table(title=f"{model}: one decode token at {context} tokens of context (ms; % of the step)")
    for col in ("p", "method", "rank", "step", *PHASES, "rounds/step", "same tokens"):
        table.add_column(col, justify="left" if col == "method" else "right")
    records = []
    for p in nproc:
        spec = ProfileSpec(model=model, context=context, new_tokens=new_tokens, methods=tuple(method[:1] if p == 1 else method),
                           threads=threads or max(1, (os.cpu_count() or 1) // p), warmup=warmup, repeats=repeats,
                           transports=tuple(dict.fromkeys(transport)) if p > 1 or kind == "cuda" else ("shm",),
                           device=kind, dtype=torch_dtype(dtype), weight_format=weight_format, kv_cache_dtype=kv_cache_dtype,
                           activation_format=activation_format)
        reports = run_profile(spec, p)
        variants = [(m, t) for m in spec.methods for t in spec.transports]
        reference = reports[0][variant_name(*variants[0])]["generated_ids"]
        for method_name, transport_name in variants:
            name = variant_name(method_name, transport_name)
            for rank, report in enumerate(reports):
                entry = report[name]
                ph = entry["phases"]
                cells = [f"{ph[x] * 1e3:.2f} ({100 * ph[x] / ph['step']:.0f}%)" for x in PHASES]
                table.add_row(str(p), name if p > 1 else "-", str(rank), f"{ph['step'] * 1e3:.2f}", *cells,
                              f"{entry['rounds_per_step']:.0f}",
                              "yes" if entry["generated_ids"] == reference and entry["same_ids_every_run"] else "NO")
                records.append({"model": model, "context": context, "p": p, "method": method_name, "transport": transport_name,
                                "weight_format": weight_format, "kv_cache_dtype": kv_cache_dtype,
                                "rank": rank, **entry})
    Console(width=220).print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(records, indent=1))


def _load_records(path: Path, option: str) -> list[dict]:
    """Benchmark records saved by `bench decode --output x.json` (a list) or `bench validate
    --output` (an object with "records"); refuses, in one line naming the file, anything else."""
    from treeattn.sim.plots import check_records

    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise _refuse(f"{option} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise _refuse(f"{option} {path}: cannot read it: {err}") from None
    except json.JSONDecodeError as err:
        raise _refuse(f"{option} {path}: not JSON ({err})") from None
    if isinstance(saved, dict) and "records" not in saved:
        raise _refuse(f"{option} {path}: not benchmark records: an object without a \"records\" list")
    rows = saved["records"] if isinstance(saved, dict) else saved
    try:
        check_records(rows, "median_seconds")
    except ValueError as err:
        raise _refuse(f"{option} {path}: not benchmark records: {err}") from None
    return rows


@bench_app.command("serve")
def serve_command(
    base_url: str = typer.Option(..., "--base-url",
                                 help="The server, e.g. http://127.0.0.1:8000 (treeattn serve, vLLM, llama.cpp)."),
    model: str | None = typer.Option(None, "--model", help="The model id to send (default: the first /v1/models lists)."),
    endpoint: str = typer.Option("/v1/completions", "--endpoint", help="/v1/completions or /v1/chat/completions."),
    num_prompts: int = typer.Option(100, "--num-prompts", min=1, help="Requests to send."),
    input_len: int = typer.Option(512, "--input-len", min=1, help="Synthetic prompts: tokens per prompt."),
    output_len: int = typer.Option(128, "--output-len", min=1,
                                   help="max_tokens of each request (answers are this long: ignore_eos)."),
    range_ratio: float = typer.Option(0.0, "--range-ratio", min=0.0, max=0.99,
                                      help="Synthetic lengths uniform in len x [1-r, 1+r]."),
    min_token_id: int = typer.Option(100, "--min-token-id", min=0,
                                     help="Synthetic prompts' token ids are drawn from [min, max)."),
    max_token_id: int = typer.Option(1000, "--max-token-id", min=1),
    dataset_path: Path | None = typer.Option(None, "--dataset-path", help="Prompts from a file: one per line, or .jsonl objects "
                                             "with 'prompt' and optionally 'output_len'."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Requests per second (inf: all at once)."),
    arrival: str = typer.Option("poisson", "--arrival", help="poisson (gamma intervals, --burstiness) or constant."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the intervals: 1 is Poisson, lower is burstier."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1, help="Requests in flight at most "
                                               "(with --request-rate inf: a fixed concurrency)."),
    goodput: str = typer.Option("", "--goodput", help="SLOs in ms, e.g. 'ttft:500 tpot:50 e2el:5000': good requests per second."),
    percentiles: str = typer.Option("50,90,99", "--percentiles", help="Percentiles of ttft, tpot, itl and e2el to report."),
    seed: int = typer.Option(0, "--seed"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="Send ignore_eos so that answers are --output-len long."),
    label: str | None = typer.Option(None, "--label", help="A label stored in the result."),
    extra_body: str = typer.Option("", "--extra-body", help="A JSON object of more fields for every request, e.g. "
                                   "'{\"logit_bias\": {\"2\": -100}}' for a server without ignore_eos."),
    result_file: Path | None = typer.Option(None, "--result-file", "-o",
                                            help="Write the result JSON (vllm bench serve's keys) here."),
) -> None:
    """Open-loop load on an OpenAI-compatible server: TTFT, TPOT, ITL and end-to-end latency
    percentiles, throughput and goodput, as `vllm bench serve` reports them (its JSON keys)."""
    from treeattn.bench.serving import ServeBenchConfig, parse_goodput, report_lines, run_serve_benchmark

    _check_outputs([("--result-file", result_file, (".json",))])
    try:
        config = ServeBenchConfig(base_url=base_url.rstrip("/"), model=model, endpoint=endpoint, num_prompts=num_prompts,
                                  input_len=input_len, output_len=output_len, range_ratio=range_ratio, min_token_id=min_token_id,
                                  max_token_id=max_token_id, dataset_path=None if dataset_path is None else str(dataset_path),
                                  request_rate=request_rate, arrival=arrival, burstiness=burstiness,
                                  max_concurrency=max_concurrency,
                                  goodput=parse_goodput(goodput), percentiles=_percentiles(percentiles),
                                  seed=seed, api_key=os.environ.get("OPENAI_API_KEY") or os.environ.get("TREEATTN_API_KEY"),
                                  ignore_eos=ignore_eos, label=label, extra_body=_json_object(extra_body, "--extra-body"))
        result = run_serve_benchmark(config)
    except ValueError as exc:
        raise _refuse(str(exc)) from None
    for line in report_lines(result, config.percentiles):
        typer.echo(line)
    if result_file is not None:
        result_file.write_text(json.dumps(result, indent=1) + "\n")
    if result["failed"]:
        typer.echo(f"{result['failed']} of {config.num_prompts} requests failed; first: "
                   f"{next(e for e in result['errors'] if e)}", err=True)
        raise typer.Exit(1)


def _json_object(text: str, flag: str) -> dict:
    """A flag's JSON object ("" -> {}); ValueError naming the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} must be a JSON object, got {text[:60]!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"percentiles must be numbers in (0, 100) separated by commas, got {text!r}") from None
