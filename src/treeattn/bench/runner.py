"""The decode benchmark: time every method of a `SweepConfig` on real process groups.

For each world size one process group runs every (sequence length, method) case:

1. The ranks first all-gather their configuration; if any rank's differs, every rank raises the
   same ValueError naming the differing fields (a benchmark whose ranks disagree never starts).
2. Per case, each rank draws q (the same on all ranks) and its own K, V shard and runs the method
   once with the cross-rank input check while its peak resident memory is tracked; then once
   more inside ``ta.comm_stats()`` (bytes, messages, rounds per op of one timed step), then
   `warmup` untimed calls, then `repeats` timed calls. Each timed call
   starts right after a barrier, so the ranks start together; the call's latency is the time of
   the slowest rank. The record keeps the median, p10 and p90 over the repetitions.
3. Rank 0 appends one JSON line per finished case to a records file (the parent follows it for
   progress) and returns the records.
4. If the group fails (a rank raised, died or stopped answering), the finished cases stay in the
   records file, the running case becomes a record with an "error", and a new group runs the
   cases after it (run_decode_sweep).

Peak memory on CPU is the process's resident high-water mark (reset through
/proc/self/clear_refs) minus its resident size before the case's tensors were made, with glibc
told to return large blocks to the system (MALLOC_MMAP_THRESHOLD_); on CUDA it is
torch.cuda.max_memory_allocated. It includes the K, V shard, as the paper's eq. 8-9 do.

"local" runs on rank 0 alone with the whole cache (the single-device baseline); the other ranks
wait at the barrier.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

import treeattn.parallel as par
from treeattn.bench.config import SweepConfig, shard_bounds
from treeattn.ops import attention

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------ memory


def _proc_status_bytes(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


class PeakMemory:
    """Peak memory of this rank over a block, relative to its start (bytes; None if unknown)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = _proc_status_bytes("VmRSS")
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            except OSError:
                self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._start is not None:
            peak = _proc_status_bytes("VmHWM")
            self.peak_bytes = None if peak is None else max(0, peak - self._start)


def _interface_tx_bytes() -> int | None:
    """tx byte counter of the interface gloo uses (GLOO_SOCKET_IFNAME), or None if unset."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if not name:
        return None
    try:
        return int(Path(f"/sys/class/net/{name}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------ inputs


def _device(config: SweepConfig, rank: int) -> torch.device:
    if config.backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def make_inputs(config: SweepConfig, seq_len: int, world_size: int, rank: int, whole: bool = False):
    """q (B, 1, Hq, D), the same on every rank, and this rank's shard k, v (B, t_r, Hkv, D).

    With whole=True, k and v hold all seq_len tokens (for "local"). Values are N(0, 1) drawn on
    the CPU from fixed seeds, so any rank can rebuild any shard.
    """
    B, Hq, D = config.batch, config.heads, config.head_dim
    Hkv = config.kv_heads or Hq
    dtype, device = config.torch_dtype, _device(config, rank)
    q = torch.randn(B, 1, Hq, D, generator=torch.Generator().manual_seed(config.seed)).to(dtype)
    start, stop = (0, seq_len) if whole else shard_bounds(seq_len, world_size, rank)
    g = torch.Generator().manual_seed(config.seed + 1 + (0 if whole else rank))
    k = torch.randn(B, stop - start, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, stop - start, Hkv, D, generator=g).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def method_call(method: str, config: SweepConfig, rank: int) -> Callable:
    """fn(q, k, v, check) running one decode step of `method` on this rank."""
    topology = par.Topology(ranks_per_node=config.ranks_per_node) if config.ranks_per_node else None
    if method in ("allreduce", "onepass", "tree", "twolevel"):
        return lambda q, k, v, check: par.tree_decode(q, k, v, method=method, topology=topology, check_inputs=check)
    if method in ("ring-kv", "ring-q"):
        ring_decode = par.ring_decode
        pass_kv = method == "ring-kv"
        return lambda q, k, v, check: ring_decode(q, k, v, pass_kv=pass_kv, check_inputs=check)
    if method == "local":
        return lambda q, k, v, check: attention(q, k, v) if rank == 0 else None
    raise ValueError(f"unknown method {method!r}")


# ---------------------------------------------------------------------------- configuration


def check_config_agrees(config: SweepConfig) -> None:
    """All-gather every rank's configuration; raise the same ValueError on every rank if any
    differs from rank 0's, naming the fields."""
    mine = json.loads(config.to_json())
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = []
    for r, other in enumerate(everyone):
        if other != everyone[0]:
            fields = sorted(k for k in set(other) | set(everyone[0]) if other.get(k) != everyone[0].get(k))
            diffs = ", ".join(f"{k}: rank 0 has {everyone[0].get(k)!r}, rank {r} has {other.get(k)!r}" for k in fields)
            problems.append(diffs)
    if problems:
        raise ValueError("benchmark refused to start: the ranks disagree on the configuration: " + "; ".join(problems))


# ------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_case(config: SweepConfig, rank: int, world_size: int, seq_len: int, method: str) -> dict | None:
    """Run one case on this rank; returns the record on rank 0, None elsewhere."""
    device = _device(config, rank)
    fn = method_call(method, config, rank)
    with PeakMemory(device) as memory:
        if method == "local" and rank != 0:
            q = k = v = None  # only rank 0 holds the cache
        else:
            q, k, v = make_inputs(config, seq_len, world_size, rank, whole=method == "local")
        fn(q, k, v, True)  # validates the inputs across ranks (one extra small allgather)
        _sync(device)
    with par.comm_stats() as stats:
        fn(q, k, v, False)  # what one timed step communicates
    for _ in range(config.warmup):
        fn(q, k, v, False)
    _sync(device)
    tx_start = _interface_tx_bytes()
    elapsed = []
    for _ in range(config.repeats):
        dist.barrier()
        start = time.perf_counter()
        fn(q, k, v, False)
        _sync(device)
        elapsed.append(time.perf_counter() - start)
    tx_end = _interface_tx_bytes()
    mine = {
        "elapsed": elapsed,
        "interface_tx_bytes": None if tx_start is None or tx_end is None else tx_end - tx_start,
        "stats": stats.as_dict(),
        "peak_memory_bytes": memory.peak_bytes,
    }
    gathered: list[dict | None] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    slowest = [max(g["elapsed"][i] for g in gathered) for i in range(config.repeats)]  # type: ignore[index]
    per_rank_stats = [g["stats"] for g in gathered]  # type: ignore[index]
    decode_bytes = [s["bytes_sent"] for s in per_rank_stats]
    decode_rounds = [s["rounds"] for s in per_rank_stats]
    decode_messages = [s["messages"] for s in per_rank_stats]
    peaks = [g["peak_memory_bytes"] for g in gathered]  # type: ignore[index]
    return {
        "method": method,
        "gpus": world_size,
        "devices": 1 if method == "local" else world_size,
        "seq_len": seq_len,
        "heads": config.heads,
        "kv_heads": config.kv_heads or config.heads,
        "head_dim": config.head_dim,
        "batch": config.batch,
        "dtype": config.dtype,
        "backend": config.backend,
        "ranks_per_node": config.ranks_per_node,
        "threads_per_rank": config.threads_per_rank,
        "warmup": config.warmup,
        "repeats": config.repeats,
        "median_seconds": statistics.median(slowest),
        "p10_seconds": _percentile(slowest, 10),
        "p90_seconds": _percentile(slowest, 90),
        "slowest_rank_seconds": slowest,
        "bytes": max(decode_bytes),
        "rounds": max(decode_rounds),
        "messages": max(decode_messages),
        "bytes_per_rank": decode_bytes,
        "rounds_per_rank": decode_rounds,
        "by_op_per_rank": [s["by_op"] for s in per_rank_stats],
        # bytes that left each node's network interface per timed step (GLOO_SOCKET_IFNAME;
        # read by every rank, so ranks of one node report the same counter), barriers included
        "interface_tx_bytes_per_step": [
            None if g["interface_tx_bytes"] is None else g["interface_tx_bytes"] / config.repeats for g in gathered  # type: ignore[index]
        ],
        "peak_memory_bytes": max((p for p in peaks if p is not None), default=None),
        "peak_memory_per_rank": peaks,
    }


def run_rank(rank: int, world_size: int, config_json: str, records_path: str | None = None) -> list[dict] | None:
    """Body of one benchmark rank (torch.distributed already initialized): every case of
    `config_json` (a SweepConfig for this world size). Rank 0 returns the records and appends
    each as a JSON line to `records_path`; the other ranks return None."""
    config = SweepConfig.from_json(config_json)
    torch.set_num_threads(config.threads_per_rank)
    check_config_agrees(config)
    if world_size not in config.world_sizes:
        raise ValueError(f"this group has {world_size} ranks but the configuration lists world sizes {config.world_sizes}")
    records = []
    for seq_len in config.seq_lens:
        for method in config.methods:
            record = run_case(config, rank, world_size, seq_len, method)
            if rank == 0:
                records.append(record)
                if records_path:
                    with open(records_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
    return records if rank == 0 else None


# ------------------------------------------------------------------------------------- sweep


def run_decode_sweep(
    config: SweepConfig,
    records_path: str | Path | None = None,
    launcher: Callable[[SweepConfig, int, str | None], list[dict]] | None = None,
) -> list[dict]:
    """Run the whole sweep, one process group per world size; a case that fails becomes a record
    with an "error" and the sweep goes on.

    When a group fails (a rank raised, died, or stopped answering), the cases it finished are kept
    (rank 0 appends each to the records file as soon as it is done), the case it was running is
    recorded as failed (see `failed_record`), and a new group runs the cases after it.

    Args:
        config: the sweep.
        records_path: if given, every case (finished or failed) is appended there as a JSON line
            as soon as it is known (follow it for progress); otherwise a temporary file is used.
        launcher: launcher(config_for_one_world_size, world_size, records_path) -> records; it
            must have rank 0 append each finished case to records_path. The default spawns local
            processes with ta.spawn (see treeattn.bench.netns for ranks in network namespaces).

    Returns:
        One record per (world size, seq_len, method), in sweep order.
    """
    launch = launcher or spawn_launcher
    with tempfile.TemporaryDirectory(prefix="treeattn-bench-") as tmp:
        path = Path(records_path) if records_path is not None else Path(tmp) / "records.jsonl"
        path.touch()
        start = len(_read_records(path))
        for p in config.world_sizes:
            pending = [config.for_world(p)]  # sub-sweeps still to run, in order
            while pending:
                part = pending.pop(0)
                before = len(_read_records(path))
                try:
                    launch(part, p, str(path))
                except Exception as err:  # noqa: BLE001 -- the case becomes a failed record; the sweep goes on
                    cases = _cases(part)
                    done = len(_read_records(path)) - before
                    seq_len, method = cases[done]
                    record = failed_record(part, p, seq_len, method, err)
                    logger.warning("case %s p=%d N=%d failed: %s", method, p, seq_len, record["error"])
                    with open(path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                    pending = _after(part, done + 1) + pending
        return _read_records(path)[start:]


def failed_record(config: SweepConfig, world_size: int, seq_len: int, method: str, err: BaseException) -> dict:
    """The record of a case that did not finish: the case, the sweep's settings, and "error"
    (one line: for a SpawnError the first failed rank and its error)."""
    text = err.summary if isinstance(err, par.SpawnError) else (str(err).strip().splitlines() or [""])[0]
    return {
        "method": method, "gpus": world_size, "devices": 1 if method == "local" else world_size, "seq_len": seq_len,
        "heads": config.heads, "kv_heads": config.kv_heads or config.heads, "head_dim": config.head_dim, "batch": config.batch,
        "dtype": config.dtype, "backend": config.backend, "ranks_per_node": config.ranks_per_node,
        "threads_per_rank": config.threads_per_rank, "warmup": config.warmup, "repeats": config.repeats,
        "error": f"{type(err).__name__}: {text}"[:500],
    }


def _cases(config: SweepConfig) -> list[tuple[int, str]]:
    """(seq_len, method) in the order run_rank runs them."""
    return [(n, m) for n in config.seq_lens for m in config.methods]


def _after(config: SweepConfig, k: int) -> list[SweepConfig]:
    """Sub-sweeps that run the cases of `config` from the k-th on (run_rank's order)."""
    n_methods = len(config.methods)
    row, col = divmod(k, n_methods)
    parts = []
    if row < len(config.seq_lens) and col:
        parts.append(replace(config, seq_lens=(config.seq_lens[row],), methods=config.methods[col:]))
        row += 1
    if row < len(config.seq_lens):
        parts.append(replace(config, seq_lens=config.seq_lens[row:]))
    return parts


def _read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spawn_launcher(config: SweepConfig, world_size: int, records_path: str | None) -> list[dict]:
    """Run one world size on local processes started by ta.spawn."""
    from treeattn.engine.measure import malloc_env

    with malloc_env():  # read by glibc when the rank processes start
        results = par.spawn(run_rank, world_size, config.to_json(), records_path, backend=config.backend, timeout=config.timeout,
                             threads=config.threads_per_rank, method="spawn")  # spawned: glibc reads MALLOC_ENV at the start
    return results[0]


def write_records(records: list[dict], path: Path) -> None:
    """Write records as JSON (a list) or CSV (the scalar fields of every record, failed cases'
    "error" included), by the file's suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        import csv

        scalar = list(dict.fromkeys(k for r in records for k, v in r.items() if not isinstance(v, (list, dict))))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=scalar, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(records)
    else:
        path.write_text(json.dumps(records, indent=1))


def check_output_path(path: Path, option: str, suffixes: tuple[str, ...] = (".json", ".csv")) -> None:
    """Raise ValueError (naming `option`) unless `path` can be written as one of `suffixes`: checked
    before a run, so that a long run does not end in a write error. Creates missing parent folders."""
    path = Path(path)
    if path.suffix not in suffixes:
        raise ValueError(f"{option} {path}: expected a {' or '.join(suffixes)} file, got suffix {path.suffix or '(none)'!r}")
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a folder, expected a file")
    _check_writable_folder(path.parent, option, f"{option} {path}")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        raise ValueError(f"{option} {path}: cannot write it: {err.strerror or err}") from None
    if not existed:
        path.unlink()


def check_output_folder(path: Path, option: str) -> None:
    """Raise ValueError (naming `option`) unless `path` is, or can be made, a writable folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path}: is a file, expected a folder")
    _check_writable_folder(path, option, f"{option} {path}")


def _check_writable_folder(folder: Path, option: str, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{what}: cannot create folder {folder}: {err.strerror or err}") from None
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise ValueError(f"{what}: cannot write in folder {folder}: {err.strerror or err}") from None


def check_resources(config: SweepConfig, memory_bytes: int | None = None) -> None:
    """Raise ValueError, naming the option, if this machine cannot run `config`: backend "nccl"
    without a CUDA device per rank, or K/V caches larger than the memory (the machine's RAM for
    gloo, since all ranks share it; one GPU's memory per rank for nccl).

    The estimate is the K/V cache of the longest sequence: 2 * B * N * Hkv * D * itemsize over
    all ranks, twice that with "ring-kv" (each rank also holds the shard in flight)."""
    from treeattn.engine.memory import device_memory_bytes, format_bytes

    p_max = max(config.world_sizes)
    if config.backend == "nccl":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < p_max:
            raise ValueError(f"--backend nccl needs one CUDA device per rank ({p_max} for world size {p_max}), found {found}"
                             + ("" if found else " (torch.cuda.is_available() is False); use --backend gloo on CPUs"))
    n = max(config.seq_lens)
    item = torch.empty((), dtype=config.torch_dtype).element_size()
    total = 2 * config.batch * n * (config.kv_heads or config.heads) * config.head_dim * item
    total *= 2 if "ring-kv" in config.methods else 1
    if config.backend == "nccl":
        p_min = min(config.world_sizes)
        needed = total if "local" in config.methods else -(-total // p_min)  # the busiest GPU
        available = memory_bytes if memory_bytes is not None else device_memory_bytes("cuda")
        where = "one GPU"
    else:
        needed, available, where = total, memory_bytes if memory_bytes is not None else device_memory_bytes("cpu"), "this machine"
    if available is not None and needed > available:
        raise ValueError(f"--seq-len {n}: the K/V cache needs {format_bytes(needed)} "
                         f"({config.batch} x {n} tokens x {config.kv_heads or config.heads} KV heads x {config.head_dim} x "
                         f"{config.dtype}, K and V{', twice for ring-kv' if 'ring-kv' in config.methods else ''}), "
                         f"more than the {format_bytes(available)} of memory of {where}")


__all__ = [
    "PeakMemory",
    "SweepConfig",
    "check_config_agrees",
    "check_output_folder",
    "check_output_path",
    "check_resources",
    "failed_record",
    "make_inputs",
    "run_case",
    "run_decode_sweep",
    "run_rank",
    "spawn_launcher",
    "write_records",
]
