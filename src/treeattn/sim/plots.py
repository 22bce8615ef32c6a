"""Figures in the style of the Tree Attention paper's figures 4-5, for measured or predicted records.

A record is a dict with at least `method`, `gpus`, `seq_len`, a latency in seconds (the key is a
parameter: "median_seconds" for benchmarks, "predicted_seconds" for the cost model), and
optionally `bytes` (sent by the busiest rank) and `peak_memory_bytes`. Methods keep one colour
and marker in every figure. Legends sit beside the axes, never over a line. Each plot_* function
writes a PNG and returns its path; the *_figure functions build the matplotlib figure (for tests).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

METHOD_STYLE: dict[str, tuple[str, str]] = {
    "onepass": ("tab:cyan", "P"),
    "allreduce": ("tab:blue", "o"),
    "tree": ("tab:green", "s"),
    "twolevel": ("tab:purple", "D"),
    "ring-kv": ("tab:red", "^"),
    "ring-q": ("tab:orange", "v"),
    "local": ("tab:gray", "x"),
}
TREE_METHODS = ("onepass", "allreduce", "tree", "twolevel")
# The speedup figure: each tree method's line style, and its shift along the p axis (in octaves) so that
# methods with equal speedups (tree and twolevel often are) stay visible side by side.
SPEEDUP_LINES = {"onepass": ("-", -0.075), "allreduce": ("-.", -0.025), "tree": ("--", 0.025), "twolevel": (":", 0.075)}
LEGEND_BESIDE = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": 8}


def _style(method: str) -> dict[str, str]:
    color, marker = METHOD_STYLE.get(method, ("black", "."))
    return {"color": color, "marker": marker}


def _seq_label(n: int) -> str:
    """80000 -> 80K, 5120000 -> 5.12M, 16384 -> 16K (binary K when not a multiple of 1000)."""
    if n >= 10**6 and n % 10**4 == 0:
        return f"{n / 1e6:g}M"
    if n % 1000 == 0:
        return f"{n // 1000}K"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def _seq_axis(ax, lengths: Sequence[int]) -> None:
    """Log x axis with one labelled tick per measured sequence length."""
    ax.set_xscale("log")
    ax.set_xticks(sorted(lengths))
    ax.set_xticklabels([_seq_label(int(n)) for n in sorted(lengths)], rotation=45 if len(lengths) > 5 else 0)
    ax.xaxis.set_minor_formatter(NullFormatter())


def _series(records: Iterable[dict], x: str, y: str, **fixed: object) -> dict[str, list[tuple[float, float]]]:
    """method -> sorted (x, y) points of the records matching `fixed`."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if all(r.get(k) == v for k, v in fixed.items()) and r.get(y) is not None:
            out[r["method"]].append((float(r[x]), float(r[y])))
    return {m: sorted(pts) for m, pts in out.items()}


def _save(fig, path: Path) -> Path:
    """Write `fig` with the legends beside its axes kept whole ("tight" counts every legend, also one
    added with add_artist), then close it."""
    from matplotlib.legend import Legend

    legends = [c for ax in fig.axes for c in ax.get_children() if isinstance(c, Legend)]
    fig.savefig(path, dpi=120, bbox_inches="tight", bbox_extra_artists=legends)
    plt.close(fig)
    return path


def latency_figure(records: Sequence[dict], latency_key: str, title: str):
    """Latency vs sequence length, one line per method, one panel per world size (figure 4)."""
    sizes = sorted({r["gpus"] for r in records})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), squeeze=False)
    for ax, p in zip(axes[0], sizes):
        for method, pts in _series(records, "seq_len", latency_key, gpus=p).items():
            xs, ys = zip(*pts)
            ax.plot(xs, [y * 1e3 for y in ys], label=method, **_style(method))
        _seq_axis(ax, {r["seq_len"] for r in records})
        ax.set_yscale("log")
        ax.set_title(f"p = {p}")
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("latency per decode step (ms)")
    axes[0][-1].legend(**LEGEND_BESIDE)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_latency(records: Sequence[dict], path: Path, latency_key: str, title: str) -> Path:
    return _save(latency_figure(records, latency_key, title), path)


def speedup_figure(records: Sequence[dict], latency_key: str, title: str, baseline: str = "ring-kv"):
    """Speedup of each tree method over `baseline` vs world size (figure 5): colour = sequence length,
    line style and marker = method (SPEEDUP_LINES, METHOD_STYLE), each method's points shifted a little
    along p so that equal speedups do not hide one another; two legends say which is which."""
    from matplotlib.lines import Line2D

    latency = {(r["method"], r["gpus"], r["seq_len"]): r[latency_key] for r in records}
    lengths = sorted({r["seq_len"] for r in records})
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    drawn = []
    for i, n in enumerate(lengths):
        color = cmap(i / max(1, len(lengths) - 1))
        for method in TREE_METHODS:
            pts = sorted(
                (p, latency[(baseline, p, n)] / latency[(method, p, n)])
                for (m, p, nn) in latency
                if m == method and nn == n and (baseline, p, n) in latency and latency[(method, p, n)] > 0
            )
            if not pts:
                continue
            style, shift = SPEEDUP_LINES[method]
            xs, ys = zip(*pts)
            ax.plot([x * 2**shift for x in xs], ys, linestyle=style, marker=METHOD_STYLE[method][1], markersize=5,
                    color=color, label=f"{method} N={_seq_label(n)}")
            if method not in drawn:
                drawn.append(method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["gpus"] for r in records})
    ax.set_xticks(sizes, [str(p) for p in sizes])
    ax.set_xlabel("world size p (each method's points drawn slightly apart)")
    ax.set_ylabel(f"speedup over {baseline}")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    by_length = [Line2D([], [], color=cmap(i / max(1, len(lengths) - 1)), linewidth=3, label=f"N={_seq_label(n)}")
                 for i, n in enumerate(lengths)]
    by_method = [Line2D([], [], color="black", linestyle=SPEEDUP_LINES[m][0], marker=METHOD_STYLE[m][1], label=m) for m in drawn]
    first = ax.legend(handles=by_length, title="sequence length", **LEGEND_BESIDE)
    ax.add_artist(first)
    ax.legend(handles=by_method, title="method", loc="lower left", bbox_to_anchor=(1.02, 0.0), borderaxespad=0.0, fontsize=8)
    fig.tight_layout()
    return fig


def plot_speedup(records: Sequence[dict], path: Path, latency_key: str, title: str, baseline: str = "ring-kv") -> Path:
    return _save(speedup_figure(records, latency_key, title, baseline), path)


def per_method_figure(records: Sequence[dict], key: str, scale: float, ylabel: str, title: str):
    """`key` / scale vs sequence length at the largest world size, one line per method."""
    p = max(r["gpus"] for r in records)
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    for method, pts in _series(records, "seq_len", key, gpus=p).items():
        if all(y == 0 for _, y in pts):
            continue  # nothing to draw on a log axis (local sends no bytes)
        xs, ys = zip(*pts)
        ax.plot(xs, [y / scale for y in ys], label=method, **_style(method))
    _seq_axis(ax, {r["seq_len"] for r in records})
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\np = {p}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**LEGEND_BESIDE)
    fig.tight_layout()
    return fig


def plot_memory(records: Sequence[dict], path: Path, title: str) -> Path:
    """Peak memory per rank vs sequence length at the largest world size."""
    return _save(per_method_figure(records, "peak_memory_bytes", 2**20, "peak memory per rank (MiB)", title), path)


def plot_comm(records: Sequence[dict], path: Path, title: str) -> Path:
    """Bytes sent by the busiest rank per decode step vs sequence length."""
    return _save(per_method_figure(records, "bytes", 1.0, "bytes sent per step (busiest rank)", title), path)


def check_records(records: object, latency_key: str) -> None:
    """Raise ValueError unless `records` is a non-empty list of benchmark records: dicts with
    method, gpus, seq_len and, unless the case failed ("error"), a number under `latency_key`."""
    if not isinstance(records, list) or not records:
        raise ValueError(f"expected a non-empty list of benchmark records, got {type(records).__name__}"
                         + (" (empty)" if isinstance(records, list) else ""))
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"record {i} is a {type(r).__name__}, expected an object")
        needed = ("method", "gpus", "seq_len") + (() if "error" in r else (latency_key,))
        missing = [k for k in needed if k not in r]
        if missing:
            raise ValueError(f"record {i} has no {', '.join(missing)}")
        numbers = {k: r[k] for k in needed[1:]}
        bad = [k for k, v in numbers.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise ValueError(f"record {i}: {bad[0]} must be a number, got {r[bad[0]]!r:.40}")


def make_figures(records: Sequence[dict], out_dir: Path, prefix: str, latency_key: str, title: str) -> list[Path]:
    """Write the four figures <prefix>_{latency,speedup,memory,comm}.png into out_dir. Records of
    failed cases (with an "error") are left out.

    Raises:
        ValueError: no record to plot, or a record that is not a benchmark record (says which).
    """
    check_records(records, latency_key)
    records = [r for r in records if "error" not in r]
    if not records:
        raise ValueError("no records to plot (every case failed)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency(records, out_dir / f"{prefix}_latency.png", latency_key, title)]
    if any(r["method"] == "ring-kv" for r in records) and any(r["method"] in TREE_METHODS for r in records):
        paths.append(plot_speedup(records, out_dir / f"{prefix}_speedup.png", latency_key, title))
    if any(r.get("peak_memory_bytes") for r in records):
        paths.append(plot_memory(records, out_dir / f"{prefix}_memory.png", title))
    if any(r.get("bytes") for r in records):
        paths.append(plot_comm(records, out_dir / f"{prefix}_comm.png", title))
    return paths
