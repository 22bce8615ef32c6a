"""The figures: the scaling plots show every tree method (onepass, the default, included) apart from
one another, legends beside the axes and never over a line, the needle heatmap with a colour bar and
a title the figure holds. Checked on the matplotlib figures themselves (no image comparison)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from treeattn.sim.plots import METHOD_STYLE, TREE_METHODS, per_method_figure, speedup_figure  # noqa: E402
from treeattn.eval.needle import NeedleCell, NeedleReport, heatmap, heatmap_figure  # noqa: E402
from treeattn.sim import DecodeShape, load_cluster, predict_decode  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def records():
    cluster = load_cluster("dgx-h100")
    out = []
    for p in (8, 64):
        for n in (80_000, 640_000):
            for method in (*TREE_METHODS, "ring-kv", "ring-q"):
                out.append(predict_decode(cluster, DecodeShape(seq_len=n, heads=16, head_dim=128, dtype="bf16"), p,
                                          method).as_dict())
    return out


def _extent(artist, fig):
    return artist.get_window_extent(fig.canvas.get_renderer())


def test_speedup_figure_draws_every_tree_method_apart_with_its_own_marker(records):
    fig = speedup_figure(records, "predicted_seconds", "t")
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    for method in TREE_METHODS:
        assert f"{method} N=80K" in lines and f"{method} N=640K" in lines, method
    # the same N and p: each method at its own x, with its own marker and line style
    xs = {m: tuple(lines[f"{m} N=80K"].get_xdata()) for m in TREE_METHODS}
    assert len(set(xs.values())) == len(TREE_METHODS)
    assert len({lines[f"{m} N=80K"].get_marker() for m in TREE_METHODS}) == len(TREE_METHODS)
    assert len({str(lines[f"{m} N=80K"].get_linestyle()) for m in TREE_METHODS}) == len(TREE_METHODS)
    for m in TREE_METHODS:  # shifted by less than a tenth of an octave from the true p
        assert all(abs(x / p - 1) < 0.1 for x, p in zip(xs[m], (8, 64)))
    legends = [c for c in ax.get_children() if isinstance(c, matplotlib.legend.Legend)]
    texts = {t.get_text() for legend in legends for t in legend.get_texts()}
    assert set(TREE_METHODS) <= texts and {"N=80K", "N=640K"} <= texts
    fig.canvas.draw()
    for legend in legends:  # beside the axes, over no line
        assert _extent(legend, fig).x0 >= _extent(ax.patch, fig).x1
    plt.close(fig)


def test_comm_legend_sits_beside_the_axes(records):
    fig = per_method_figure(records, "bytes", 1.0, "bytes", "t")
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = ax.get_legend()
    assert "ring-kv" in {t.get_text() for t in legend.get_texts()} and "onepass" in {t.get_text() for t in legend.get_texts()}
    assert _extent(legend, fig).x0 >= _extent(ax.patch, fig).x1
    assert METHOD_STYLE["onepass"] != METHOD_STYLE["allreduce"]
    plt.close(fig)


def _report(model: str, agree: bool = True) -> NeedleReport:
    cells = [NeedleCell(length=n, depth=d, prompt_tokens=n, answer="42", reply="42" if d < 1 else "no", correct=d < 1,
                        generated_ids=[1], methods_agree=agree or d > 0) for n in (1024, 2048) for d in (0.0, 1.0)]
    return NeedleReport(model=model, nproc=2, decode="tree", method="onepass", methods=["tree (onepass)"], cells=cells,
                        load_s=1.0, total_s=2.0)


def test_needle_heatmap_has_a_colour_bar_and_a_whole_title(tmp_path):
    fig = heatmap_figure(_report("/some/where/SmolLM2-135M-Instruct.Q4_1.gguf", agree=False))
    assert len(fig.axes) == 2  # the map and its colour bar
    bar = fig.axes[1]
    assert [t.get_text() for t in bar.get_yticklabels()] == ["missed", "retrieved"]
    fig.canvas.draw()
    title = fig.axes[0].title
    assert title.get_text().startswith("SmolLM2-135M-Instruct.Q4_1.gguf\n50% retrieved, 2 rank(s)")
    assert "methods DISAGREE" in title.get_text()
    box, whole = _extent(title, fig), fig.bbox
    assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and box.y1 <= whole.y1
    plt.close(fig)
    heatmap(_report("m"), tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_saved_needle_report_round_trips():
    raw = json.loads((DOCS / "data" / "needle_smollm2_p2.json").read_text())
    report = NeedleReport.from_dict(raw)
    assert report.as_dict() == raw
