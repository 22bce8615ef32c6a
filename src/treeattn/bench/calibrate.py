"""Measure this machine and turn the measurements into the cost model's "cpu-local" cluster.

`treeattn bench calibrate` runs two gloo ranks on this host and measures:

- p2p: one-way time of a 4-byte send/recv (ping-pong / 2) -> link latency; one two-rank ring
  step (both ranks swap a 64 MiB K, V block into fresh buffers while attending to their own) minus
  its attention -> the loopback bandwidth a ring step sees (a one-at-a-time ping-pong of 64 MiB is
  reported too: it is several times faster than what a busy ring gets);
- allreduce: a 4-byte allreduce on the two ranks -> with the p2p time, splits the fixed cost of a
  call (collective_overhead) from the per-step latency (model: p2p = o + a, allreduce = o + 2a);
- attention: ta.attention of one query over t tokens (Hq=16, D=128, fp32) with 1 thread, at
  several t, alone and with both ranks running at once; a least-squares line time = a + bytes/bw
  gives the fixed cost per call and the K, V streaming rate (alone: per-rank rate; at once: the
  host's aggregate rate when all cores work);
- merge: one ta.merge_states of two decode states, 1 thread;
- busy rounds, at every world size p of `world_sizes` (p ranks, one thread each): every rank
  attends one query to BUSY_TOKENS tokens, then either stops, or does one or two ring steps back
  to back (send to the next rank, receive from the previous), or one or two allreduces back to
  back, every message one packed decode state of that attention (HEADS x (HEAD_DIM + 1) fp32, what
  the methods' rounds carry; gloo's allreduce of a few bytes takes fewer, cheaper steps than one
  of a state); the five variants alternate, each iteration barrier-aligned,
  timed on the slowest rank. The medians' differences are what the first p2p step and the first
  small collective after the attention cost, and what one more of each issued right after it
  costs; the parts beyond the idle cost above are the model's busy-round terms at p (a receiving
  rank that slept is woken and scheduled again; with p above the cores it also waits for a core);
  BUSY_TOKENS is none of the validation's shard sizes, so the term is not read off a validation case;
- memory: copy bandwidth with 1 thread and with all threads, and 1-thread matmul FLOP/s
  (reported; the model uses the attention rates, which are what decoding sees).

Each figure is the median over the repetitions of a pass, as the benchmark reports medians. The
machine may be shared and its speed drifts with other tenants' work, so `passes` whole
calibrations can be run minutes apart, keeping each figure's fastest pass (the same rule as
`treeattn bench validate --passes`). Nothing is fitted to the benchmark that the model is later
checked against.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import treeattn.parallel as par
from treeattn.ops import attention, merge_states
from treeattn.sim.hardware import Cluster, Link, host_memory_bytes

ATTENTION_TOKENS = (4096, 32768, 131072)
HEADS, HEAD_DIM = 16, 128
SMALL_BYTES = 4
LARGE_BYTES = 64 * 2**20
ONE_HOST_GPUS_PER_NODE = 1 << 20  # every rank on one host: all links are the loopback
BUSY_TOKENS = 6144  # compute between busy rounds: ~5 ms of 1-thread attention, no validation shard size
BUSY_WORLD_SIZES = (2, 4)
BUSY_MESSAGE_ELEMENTS = HEADS * (HEAD_DIM + 1)  # one packed decode state (out, lse) of the busy attention, fp32
BUSY_VARIANTS = ("compute", "p2p", "p2p_pair", "allreduce", "allreduce_pair")
BUSY_KEYS = ("busy_world_sizes", *(f"busy_{name}_seconds" for name in BUSY_VARIANTS))


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ping_pong(rank: int, nbytes: int, repeats: int) -> float:
    """One-way time of an nbytes message between ranks 0 and 1 (median round trip / 2)."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    peer = 1 - rank
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _ring_step(rank: int, nbytes: int, repeats: int) -> tuple[float, float]:
    """One two-rank ring step as pass-KV decoding runs it: both ranks post the swap of an nbytes
    K, V block (into freshly allocated buffers), attend to their own block meanwhile, then wait.
    Returns (median step seconds, median attention alone with both ranks at once)."""
    tokens = nbytes // (2 * HEADS * HEAD_DIM * 4)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=g)
    v = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=g)
    peer = 1 - rank
    attention(q, k, v)
    steps, alone = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        attention(q, k, v)
        alone.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        k_in, v_in = torch.empty_like(k), torch.empty_like(v)
        ops = [dist.P2POp(dist.isend, t, peer) for t in (k, v)] + [dist.P2POp(dist.irecv, t, peer) for t in (k_in, v_in)]
        works = dist.batch_isend_irecv(ops)
        attention(q, k, v)
        for work in works:
            work.wait()
        steps.append(time.perf_counter() - start)
        del k_in, v_in
    return statistics.median(steps), statistics.median(alone)


def _attention_times(rank: int, concurrent: bool, repeats: int) -> list[float]:
    """Median seconds of one decode attention call per t in ATTENTION_TOKENS, on rank 0 (alone:
    rank 1 waits; concurrent: both ranks run the same calls at once)."""
    results = []
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=g)
    for t in ATTENTION_TOKENS:
        k = torch.randn(1, t, HEADS, HEAD_DIM, generator=g)
        v = torch.randn(1, t, HEADS, HEAD_DIM, generator=g)
        attention(q, k, v)  # warm up
        times = []
        for _ in range(repeats):
            dist.barrier()
            if rank == 0 or concurrent:
                start = time.perf_counter()
                attention(q, k, v)
                times.append(time.perf_counter() - start)
        results.append(statistics.median(times) if times else 0.0)
        del k, v
    return results


def _busy_rounds(rank: int, world_size: int, repeats: int) -> dict | None:
    """Median slowest-rank seconds of attention alone ("compute"), attention + one ring step
    ("p2p"), + two ring steps back to back ("p2p_pair"), + one allreduce ("allreduce") and + two
    back to back ("allreduce_pair") on `world_size` busy ranks, every message BUSY_MESSAGE_ELEMENTS
    fp32; rank 0 returns them."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(1, BUSY_TOKENS, HEADS, HEAD_DIM, generator=g)
    v = torch.randn(1, BUSY_TOKENS, HEADS, HEAD_DIM, generator=g)
    token, incoming = torch.zeros(BUSY_MESSAGE_ELEMENTS), torch.zeros(BUSY_MESSAGE_ELEMENTS)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size

    def ring_step() -> None:
        ops = [dist.P2POp(dist.isend, token, nxt), dist.P2POp(dist.irecv, incoming, prev)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def two(comm):
        return lambda: (comm(), comm())

    allreduce = lambda: dist.all_reduce(token)  # noqa: E731
    variants = {
        "compute": lambda: None, "p2p": ring_step, "p2p_pair": two(ring_step),
        "allreduce": allreduce, "allreduce_pair": two(allreduce),
    }
    for comm in variants.values():  # warm up
        attention(q, k, v)
        comm()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, comm in variants.items():
            dist.barrier()
            start = time.perf_counter()
            attention(q, k, v)
            comm()
            times[name].append(time.perf_counter() - start)
    gathered: list[dict | None] = [None] * world_size
    dist.all_gather_object(gathered, times)
    if rank != 0:
        return None
    slowest = {name: [max(g[name][i] for g in gathered) for i in range(repeats)] for name in variants}  # type: ignore[index]
    return {name: statistics.median(values) for name, values in slowest.items()}


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _calibrate_rank(rank: int, world_size: int, repeats: int) -> dict | None:
    torch.set_num_threads(1)
    small = _ping_pong(rank, SMALL_BYTES, 20 * repeats)
    large = _ping_pong(rank, LARGE_BYTES, repeats)
    ring_step, ring_attention = _ring_step(rank, LARGE_BYTES, repeats)
    token = torch.zeros(1)
    allreduce = []
    for _ in range(20 * repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(token)
        allreduce.append(time.perf_counter() - start)
    alone = _attention_times(rank, concurrent=False, repeats=repeats)
    together = _attention_times(rank, concurrent=True, repeats=repeats)
    if rank != 0:
        return None
    g = torch.Generator().manual_seed(0)
    oa, ob = torch.randn(1, 1, HEADS, HEAD_DIM, generator=g), torch.randn(1, 1, HEADS, HEAD_DIM, generator=g)
    la, lb = torch.randn(1, HEADS, 1, generator=g), torch.randn(1, HEADS, 1, generator=g)
    merge = _median_time(lambda: merge_states(oa, la, ob, lb), 50 * repeats)
    return {
        "p2p_small_one_way_seconds": small,
        "p2p_large_one_way_seconds": large,
        "p2p_large_bytes": LARGE_BYTES,
        "ring_step_seconds": ring_step,
        "ring_step_attention_seconds": ring_attention,
        "allreduce_small_seconds": statistics.median(allreduce),
        "attention_tokens": list(ATTENTION_TOKENS),
        "attention_alone_seconds": alone,
        "attention_concurrent_seconds": together,
        "merge_seconds": merge,
    }


def _host_measurements(repeats: int) -> dict:
    """Copy bandwidth (1 thread, all threads) and 1-thread fp32 matmul FLOP/s, in this process."""
    saved = torch.get_num_threads()
    out = {}
    src = torch.ones(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    try:
        for label, threads in (("1_thread", 1), ("all_threads", os.cpu_count() or 1)):
            torch.set_num_threads(threads)
            seconds = _median_time(lambda: dst.copy_(src), repeats)
            out[f"copy_bandwidth_{label}"] = 2 * src.numel() * 4 / seconds  # read + write
        torch.set_num_threads(1)
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        seconds = _median_time(lambda: a @ b, repeats)
        out["matmul_flops_1_thread"] = 2 * 512**3 / seconds
    finally:
        torch.set_num_threads(saved)
    return out


def fastest_of_passes(passes: list[dict]) -> dict:
    """Combine the measurements of several calibration passes, keeping the fastest of each.

    Times and lists of times take their (elementwise) minimum; bandwidths and FLOP/s their
    maximum; the ring step and its attention come from the same pass (their difference is the
    transfer), the pass with the fastest step.
    """
    if not passes:
        raise ValueError("passes must not be empty")
    combined = dict(passes[0])
    for key, value in passes[0].items():
        values = [p[key] for p in passes]
        if key.startswith(("ring_step", "busy_")) or key in ("attention_tokens", "p2p_large_bytes"):
            continue
        if isinstance(value, list):
            combined[key] = [min(column) for column in zip(*values)]
        elif key.startswith(("copy_bandwidth", "matmul_flops")):
            combined[key] = max(values)
        else:
            combined[key] = min(values)
    fastest = min(passes, key=lambda p: p["ring_step_seconds"])
    combined["ring_step_seconds"] = fastest["ring_step_seconds"]
    combined["ring_step_attention_seconds"] = fastest["ring_step_attention_seconds"]
    if "busy_world_sizes" in passes[0]:
        # busy rounds are differences of times taken together: keep them from one pass, the
        # one whose busy compute was fastest (least disturbed by other work)
        quietest = min(passes, key=lambda p: sum(p["busy_compute_seconds"]))
        for key in BUSY_KEYS:
            if key in quietest:
                combined[key] = quietest[key]
    combined["passes"] = len(passes)
    return combined


def _busy_round_measurements(world_sizes: tuple[int, ...], repeats: int) -> dict:
    """_busy_rounds at every world size, as lists aligned with busy_world_sizes."""
    out: dict[str, list] = {key: [] for key in BUSY_KEYS}
    for p in world_sizes:
        result = par.spawn(_busy_rounds, p, repeats, threads=1)[0]
        out["busy_world_sizes"].append(p)
        for name in BUSY_VARIANTS:
            out[f"busy_{name}_seconds"].append(result[name])
    return out


def calibrate(repeats: int = 5, passes: int = 1, pause: float = 10.0, world_sizes: tuple[int, ...] = BUSY_WORLD_SIZES) -> dict:
    """Measure this host (medians over `repeats`) and return {"machine", "measurements", "cluster"} (see module doc).

    Args:
        repeats: repetitions of each measurement inside a pass (the median is kept).
        passes: whole calibrations to run, `pause` seconds apart; each figure keeps its fastest
            pass (a burst of another tenant's work can last longer than one pass).
        world_sizes: rank counts at which the busy-round costs are measured.
    """
    if repeats < 1 or passes < 1:
        raise ValueError(f"repeats and passes must be >= 1, got repeats={repeats}, passes={passes}")
    world_sizes = tuple(world_sizes)
    if not world_sizes or any(not isinstance(p, int) or p < 2 for p in world_sizes):
        raise ValueError(f"world_sizes must be integers >= 2, got {world_sizes!r}")
    runs = []
    for i in range(passes):
        if i:
            time.sleep(pause)
        measured = par.spawn(_calibrate_rank, 2, repeats, threads=1)[0]
        measured.update(_host_measurements(repeats))
        measured.update(_busy_round_measurements(world_sizes, 5 * repeats))
        runs.append(measured)
    measured = fastest_of_passes(runs)
    cluster = cluster_from_measurements(measured)
    return {
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "measurements": measured,
        "cluster": cluster.to_dict(),
    }


def cluster_from_measurements(m: dict) -> Cluster:
    """The cpu-local Cluster implied by calibrate()'s measurements."""
    kv_bytes = [2 * t * HEADS * HEAD_DIM * 4 for t in m["attention_tokens"]]
    overhead, per_byte = _line_fit(kv_bytes, m["attention_alone_seconds"])
    _, per_byte_together = _line_fit(kv_bytes, m["attention_concurrent_seconds"])
    small, allreduce = m["p2p_small_one_way_seconds"], m["allreduce_small_seconds"]
    call_overhead = max(0.0, 2 * small - allreduce)  # p2p = o + a, allreduce(2 ranks) = o + 2a
    latency = max(small - call_overhead, 1e-7)
    # the rate a ring step sees: both directions at once, while both ranks compute (p2p_overlap 0:
    # step = attention + transfer)
    transfer = max(m["ring_step_seconds"] - m["ring_step_attention_seconds"] - small, 1e-9)
    bandwidth = m["p2p_large_bytes"] / transfer
    cores = os.cpu_count() or 1
    busy_round_p2p, busy_round_collective = [], []
    busy_next_round_p2p, busy_next_round_collective = [], []
    for i, p in enumerate(m.get("busy_world_sizes", [])):
        compute, p2p, allreduce_busy = (m[f"busy_{name}_seconds"][i] for name in ("compute", "p2p", "allreduce"))
        # minus what the model already charges an idle step / a ring allreduce of p ranks
        message = BUSY_MESSAGE_ELEMENTS * 4
        idle_p2p = call_overhead + latency + message / bandwidth
        idle_allreduce = call_overhead + 2 * (p - 1) * (latency + message / (p * bandwidth))
        busy_round_p2p.append((p, max(0.0, p2p - compute - idle_p2p)))
        busy_round_collective.append((p, max(0.0, allreduce_busy - compute - idle_allreduce)))
        if "busy_p2p_pair_seconds" in m:  # calibrations before the pair variants lack them
            busy_next_round_p2p.append((p, max(0.0, m["busy_p2p_pair_seconds"][i] - p2p - idle_p2p)))
            busy_next_round_collective.append((p, max(0.0,
                                                      m["busy_allreduce_pair_seconds"][i] - allreduce_busy - idle_allreduce)))
    rank_rate = 1 / per_byte
    running = min(2, cores)
    return Cluster(
        name="cpu-local",
        gpus_per_node=ONE_HOST_GPUS_PER_NODE,
        memory_bandwidth=rank_rate,
        memory_efficiency=1.0,
        peak_flops=m["matmul_flops_1_thread"],
        flops_efficiency=1.0,
        kernel_overhead=max(0.0, overhead),
        merge_seconds=m["merge_seconds"],
        collective_overhead=call_overhead,
        intra=Link(latency=latency, bandwidth=bandwidth),
        inter=Link(latency=latency, bandwidth=bandwidth),
        p2p_overlap=0.0,
        host_cores=cores,
        host_memory_bandwidth=running / per_byte_together,
        busy_round_p2p=tuple(busy_round_p2p),
        busy_round_collective=tuple(busy_round_collective),
        busy_next_round_p2p=tuple(busy_next_round_p2p),
        busy_next_round_collective=tuple(busy_next_round_collective),
        memory_capacity=None if (ram := host_memory_bytes()) is None else float(ram),
        sources={
            "memory_capacity": "this machine's RAM (os.sysconf), shared by the ranks",
            "memory_bandwidth": "measured: K,V bytes/s of 1-thread ta.attention, one rank alone (line fit)",
            "kernel_overhead": "measured: intercept of the same line fit",
            "host_memory_bandwidth": "measured: aggregate K,V bytes/s with both ranks' attention at once",
            "host_cores": "os.cpu_count()",
            "merge_seconds": "measured: one ta.merge_states of two (1,1,16,128) states",
            "collective_overhead": "measured: 2 x p2p(4 B) - allreduce(4 B), clamped at 0",
            "intra.latency": "measured: p2p(4 B) one-way minus collective_overhead",
            "intra.bandwidth": f"measured: {LARGE_BYTES >> 20} MiB / (two-rank ring step - its attention - latency): both ranks "
                               f"swap a {LARGE_BYTES >> 20} MiB K,V block into fresh buffers while attending to their own",
            "inter": "same as intra: all ranks on one host",
            "peak_flops": "measured: 1-thread fp32 512^3 matmul",
            "p2p_overlap": "assumption: 0; gloo moves bytes with the same cores that compute",
            "busy_round_p2p": f"measured at each world size p: p busy ranks ({BUSY_TOKENS}-token attention each), median "
                              f"slowest-rank (attention + one ring step of a {BUSY_MESSAGE_ELEMENTS * 4}-byte decode state) - "
                              f"(attention alone) - its idle cost (collective_overhead + latency + bytes / bandwidth), clamped "
                              f"at 0",
            "busy_round_collective": "measured the same way with an allreduce of the state instead of the ring step, minus its "
                                     "idle ring-allreduce cost, clamped at 0",
            "busy_next_round_p2p": "measured at each world size p, same protocol: median slowest-rank (attention + two ring "
                                   "steps back to back) - (attention + one) - the idle cost of a step, clamped at 0",
            "busy_next_round_collective": "measured the same way with two allreduces of the state back to back vs one, minus "
                                          "the idle cost of one, clamped at 0",
        },
    )


def write_calibration(path: Path, repeats: int = 5, passes: int = 1, world_sizes: tuple[int, ...] = BUSY_WORLD_SIZES) -> dict:
    """Run calibrate() and write its JSON to `path`; returns it."""
    result = calibrate(repeats, passes, world_sizes=world_sizes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return result
