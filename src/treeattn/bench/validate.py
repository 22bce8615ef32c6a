"""Compare measured decode latencies with the cost model's predictions for the same cases."""

from __future__ import annotations

from treeattn.sim.hardware import Cluster
from treeattn.sim.model import predict_decode
from treeattn.sim.workload import DecodeShape


def best_of_passes(passes: list[list[dict]]) -> list[dict]:
    """Per case (method, gpus, seq_len), the record of the pass with the lowest median; each
    kept record lists every pass's median under "pass_medians". Order: the first pass's."""
    if not passes:
        raise ValueError("passes must not be empty")
    key = lambda r: (r["method"], r["gpus"], r["seq_len"])  # noqa: E731
    best: dict[tuple, dict] = {}
    medians: dict[tuple, list[float]] = {}
    for records in passes:
        for r in records:
            medians.setdefault(key(r), [])
            if "error" in r:  # a failed case: kept only if no pass measured it
                best.setdefault(key(r), r)
                continue
            medians[key(r)].append(r["median_seconds"])
            if key(r) not in best or "error" in best[key(r)] or r["median_seconds"] < best[key(r)]["median_seconds"]:
                best[key(r)] = r
    return [{**best[key(r)], "pass_medians": medians[key(r)]} for r in passes[0]]


def compare(records: list[dict], cluster: Cluster | None) -> list[dict]:
    """One row per benchmark record: predicted and measured median seconds, the relative error
    (predicted - measured) / measured against the median and against the p10 of the repeats, and
    predicted vs measured bytes and rounds. A record that carries its own "calibration_cluster"
    (validate --calibrate-each-pass) is predicted from that; the others from `cluster`. Failed
    cases (records with an "error") have no row."""
    rows = []
    for r in records:
        if "error" in r:
            continue
        shape = DecodeShape(
            seq_len=r["seq_len"], heads=r["heads"], head_dim=r["head_dim"], batch=r["batch"],
            kv_heads=r["kv_heads"], dtype=r["dtype"],
        )
        own = r.get("calibration_cluster")  # calibrated right before this record's pass
        model = Cluster.from_dict(own) if own is not None else cluster
        if model is None:
            raise ValueError("no cluster: pass one or records with a calibration_cluster")
        prediction = predict_decode(model, shape, r["gpus"], r["method"])
        measured = r["median_seconds"]
        rows.append({
            "method": r["method"],
            "pass": r.get("pass"),
            "gpus": r["gpus"],
            "seq_len": r["seq_len"],
            "predicted_seconds": prediction.predicted_seconds,
            "measured_seconds": measured,
            "p10_seconds": r["p10_seconds"],
            "p90_seconds": r["p90_seconds"],
            "error": (prediction.predicted_seconds - measured) / measured,
            "error_p10": (prediction.predicted_seconds - r["p10_seconds"]) / r["p10_seconds"],
            "predicted_bytes": prediction.bytes,
            "measured_bytes": r["bytes"],
            "predicted_rounds": prediction.rounds,
            "measured_rounds": r["rounds"],
        })
    return rows


def markdown_table(rows: list[dict], tolerance: float) -> str:
    """The validation table in Markdown; misses beyond `tolerance` are marked."""
    lines = [
        "| method | p | N | predicted ms | measured median ms (p10-p90) | error vs median | error vs p10 | bytes pred / meas | "
        "rounds pred / meas |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = "" if abs(r["error"]) <= tolerance else " **miss**"
        lines.append(
            f"| {r['method']} | {r['gpus']} | {r['seq_len']} | {r['predicted_seconds'] * 1e3:.2f} | "
            f"{r['measured_seconds'] * 1e3:.2f} ({r['p10_seconds'] * 1e3:.2f}-{r['p90_seconds'] * 1e3:.2f}) | "
            f"{r['error']:+.0%}{mark} | {r['error_p10']:+.0%} | {r['predicted_bytes']:.0f} / {r['measured_bytes']:.0f} | "
            f"{r['predicted_rounds']} / {r['measured_rounds']} |"
        )
    return "\n".join(lines)
