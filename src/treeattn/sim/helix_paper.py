"""The Helix paper's comparisons (arXiv 2507.07120) and the cost model's, as ratios.

The paper simulates decoding at a 1M-token KV cache on GB200 NVL72 (FP4 weights and KV cache, up to 64
GPUs, more than 100,000 configurations of TP, PP, EP and KVP) and compares Helix's throughput-latency
Pareto frontier with the best baseline's, in normalized units. Its figures:

    DeepSeek-R1      up to 1.5x lower time per token (TTL) at a fixed batch (the abstract), up to 32x
                     larger batches under the same latency budget (the abstract)
    Llama-3.1-405B   up to 1.13x better interactivity (1 / TTL) and up to 4x the throughput and batch

The 405B figures are the paper's evaluation section as a secondary summary of it quotes them (the
stored copy of the paper read here holds its abstract only). The paper's figures are normalized: it
gives no absolute times, so only ratios are compared.

The model's side: for each layout family (`treeattn.sim.helix.LAYOUTS`) every (N in 1..64 powers of
two, attention TP width, batch in 1..4096 powers of two) whose weights and KV cache fit in one GPU's
memory is priced; "best baseline" is the best of tp-only, kvp-only, medha and dp-attention at each point.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeattn.sim.hardware import PRESETS, Cluster
from treeattn.sim.helix import LAYOUTS, MODELS, Layout, ModelShape, StepPrediction, helix_tp_choices, predict_step

SEQ_LEN = 1_000_000
NPROCS = (1, 2, 4, 8, 16, 32, 64)
BATCHES = tuple(2**i for i in range(13))
BASELINES = ("tp-only", "kvp-only", "medha", "dp-attention")


@dataclass(frozen=True)
class PaperClaim:
    """What the paper says Helix gains over the best baseline for one model."""

    model: str
    ttl: float  # up to this much lower time per token at a fixed batch
    batch: float  # up to this much larger batch under the same TTL budget
    source: str


PAPER_CLAIMS = (
    PaperClaim("deepseek-r1", 1.5, 32.0, "abstract"),
    PaperClaim("llama-3.1-405b", 1.13, 4.0, "evaluation section, via a secondary summary"),
)


def _tp_choices(model: ModelShape, kind: str, nproc: int) -> list[int]:
    return helix_tp_choices(model, nproc) if kind in ("helix", "medha") else [1]


def frontier(cluster: Cluster, model: ModelShape, kind: str, seq_len: int = SEQ_LEN,
             nprocs: tuple[int, ...] = NPROCS, batches: tuple[int, ...] = BATCHES,
             combine: str = "alltoall") -> list[StepPrediction]:
    """Every configuration of layout family `kind` that fits in memory (all of them, not only the
    Pareto-optimal ones).

    >>> points = frontier(PRESETS["gb200-nvl72"], MODELS["llama-3.1-405b"], "kvp-only")
    >>> points  # 405B at 0.5 byte a weight is ~203 GB: no GPU of 186 GB holds a whole copy
    []
    """
    if kind not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {kind!r}")
    points = []
    for n in nprocs:
        for tp in _tp_choices(model, kind, n):
            for b in batches:
                p = predict_step(cluster, model, Layout.of(kind, n, tp=tp), seq_len, batch=b, combine=combine)
                if p.fits_memory is not False:
                    points.append(p)
    return points


def _best_ttl(points: list[StepPrediction], batch: int) -> float | None:
    """The lowest time per token among `points` at `batch` (None if none)."""
    times = [p.predicted_seconds for p in points if p.batch == batch]
    return min(times) if times else None


def _max_batch(points: list[StepPrediction], ttl: float) -> int | None:
    """The largest batch among `points` whose time per token is at most `ttl` (None if none)."""
    batches = [p.batch for p in points if p.predicted_seconds <= ttl * (1 + 1e-12)]
    return max(batches) if batches else None


@dataclass(frozen=True)
class Ratios:
    """Helix against one baseline: ttl_b1 = baseline's best TTL / Helix's at batch 1; ttl_max = the
    largest such ratio over the batches both reach; batch_max = the largest ratio of the batches each
    reaches within the same TTL budget (budgets: the baseline's own TTLs). None where the baseline
    has no configuration that fits."""

    baseline: str
    ttl_b1: float | None
    ttl_max: float | None
    batch_max: float | None


def compare(helix: list[StepPrediction], baseline: list[StepPrediction], name: str) -> Ratios:
    """The ratios of `helix`'s points over `baseline`'s (model_ratios has an example)."""
    ttl_ratios = []
    for b in BATCHES:
        h, base = _best_ttl(helix, b), _best_ttl(baseline, b)
        if h is not None and base is not None:
            ttl_ratios.append((b, base / h))
    batch_ratios = []
    for p in baseline:
        h, base = _max_batch(helix, p.predicted_seconds), _max_batch(baseline, p.predicted_seconds)
        if h is not None and base is not None:
            batch_ratios.append(h / base)
    b1 = dict(ttl_ratios).get(1)
    return Ratios(name, b1, max((r for _, r in ttl_ratios), default=None), max(batch_ratios, default=None))


def model_ratios(cluster: Cluster, model: ModelShape, seq_len: int = SEQ_LEN, combine: str = "alltoall") -> list[Ratios]:
    """Helix against each baseline family and against the best of them.

    >>> r = model_ratios(PRESETS["gb200-nvl72"], MODELS["deepseek-r1"])[-1]
    >>> r.baseline, r.ttl_b1 > 1, r.batch_max > 1
    ('best baseline', True, True)
    """
    helix = frontier(cluster, model, "helix", seq_len, combine=combine)
    families = {kind: frontier(cluster, model, kind, seq_len) for kind in BASELINES}
    ratios = [compare(helix, points, kind) for kind, points in families.items()]
    ratios.append(compare(helix, [p for points in families.values() for p in points], "best baseline"))
    return ratios


def fixed_ratios(cluster: Cluster, model: ModelShape, nproc: int, batch: int, seq_len: int = SEQ_LEN,
                 combine: str = "alltoall") -> dict[str, float]:
    """Time per token of each layout / Helix's, all on `nproc` ranks at `batch`, each layout at its best
    attention TP width, memory ignored (what the layouts cost when they run, not whether they fit).

    >>> r = fixed_ratios(PRESETS["gb200-nvl72"], MODELS["llama-3.1-405b"], 64, 1)
    >>> r["helix"], r["kvp-only"] > r["tp-only"] > 1
    (1.0, True)
    """
    best = {}
    for kind in LAYOUTS:
        best[kind] = min(predict_step(cluster, model, Layout.of(kind, nproc, tp=tp), seq_len, batch=batch,
                                      combine=combine).predicted_seconds for tp in _tp_choices(model, kind, nproc))
    return {kind: t / best["helix"] for kind, t in best.items()}


def _x(value: float | None) -> str:
    return "does not fit" if value is None else f"{value:.2f}x"


def markdown_report(cluster_name: str = "gb200-nvl72") -> str:
    """The comparison table of docs/helix.md, in Markdown (`treeattn simulate --paper` prints it after the
    Tree Attention paper's tables).

    >>> markdown_report().splitlines()[2]
    '| model | Helix vs | TTL ratio, batch 1 | TTL ratio, best over fixed batches | batch ratio at equal TTL | paper |'
    """
    cluster = PRESETS[cluster_name]
    out = [f"Helix against the baselines at {SEQ_LEN:,} cached tokens, `{cluster_name}` preset, FP4 weights and KV cache, "
           f"N = {NPROCS[0]}..{NPROCS[-1]} GPUs, batch {BATCHES[0]}..{BATCHES[-1]}; the cost model's ratios beside "
           "the paper's (the paper compares against its best baseline only):\n",
           "| model | Helix vs | TTL ratio, batch 1 | TTL ratio, best over fixed batches | batch ratio at equal TTL | paper |",
           "|---|---|---:|---:|---:|---|"]
    for claim in PAPER_CLAIMS:
        for r in model_ratios(cluster, MODELS[claim.model]):
            paper = (f"up to {claim.ttl:g}x TTL, up to {claim.batch:g}x batch ({claim.source})"
                     if r.baseline == "best baseline" else "-")
            out.append(f"| {claim.model} | {r.baseline} | {_x(r.ttl_b1)} | {_x(r.ttl_max)} | {_x(r.batch_max)} | {paper} |")
        onepass = model_ratios(cluster, MODELS[claim.model], combine="onepass")[-1]
        out.append(f"| {claim.model} | best baseline, Helix combining by onepass (treeattn's engine) | {_x(onepass.ttl_b1)} | "
                   f"{_x(onepass.ttl_max)} | {_x(onepass.batch_max)} | - |")
    out += ["", f"Time per token of each layout over Helix's on 64 GPUs at {SEQ_LEN:,} tokens, each at its best attention "
            "TP width, memory ignored (kvp-only and medha hold more than a GPU's memory for these models):\n",
            "| model | batch | " + " | ".join(LAYOUTS) + " |", "|---|---:|" + "---:|" * len(LAYOUTS)]
    for claim in PAPER_CLAIMS:
        for batch in (1, 8, 64):
            r = fixed_ratios(cluster, MODELS[claim.model], 64, batch)
            out.append(f"| {claim.model} | {batch} | " + " | ".join(f"{r[k]:.2f}x" for k in LAYOUTS) + " |")
    return "\n".join(out)
