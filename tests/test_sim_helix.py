"""The cost model of the 2-D (Helix) layout: the paper's roofline, weights and KV per rank, MLA, the
collectives, the comparison's bookkeeping, bad input and the CLI."""

from __future__ import annotations

import doctest
import json
import math

import pytest
from typer.testing import CliRunner

from treeattn.cli import app
from treeattn.sim import PRESETS, Cluster, Link, collectives, helix, helix_paper
from treeattn.sim.helix import MODELS, Layout, ModelShape, StepPrediction, layer_read_bytes, predict_step, weight_bytes_per_rank

GB200 = PRESETS["gb200-nvl72"]
FP4 = (0.5, 0.5, 2.0)


def roofline_cluster(**kw) -> Cluster:
    """The paper's Figure 1 machine: 8000 GB/s read in full, no overheads."""
    args = dict(name="roofline", gpus_per_node=72, memory_bandwidth=8e12, memory_efficiency=1.0, peak_flops=1e18,
                flops_efficiency=1.0, kernel_overhead=0.0, merge_seconds=0.0, collective_overhead=0.0,
                intra=Link(latency=1e-6, bandwidth=1e11), inter=Link(latency=1e-5, bandwidth=1e10))
    args.update(kw)
    return Cluster(**args)


# The dense model of the paper's Figure 1: Q = 128, K = 8, Hsz = 128, F = 65536 (H = Q x Hsz)
FIGURE_1 = ModelShape("figure-1", layers=1, hidden=128 * 128, heads=128, kv_heads=8, head_dim=128, ffn=65536, vocab=1)


@pytest.mark.parametrize("kind, nproc, tp", [("tp-only", 8, 8), ("tp-only", 64, 64), ("helix", 64, 8), ("helix", 16, 2)])
def test_layer_reads_follow_the_papers_roofline(kind, nproc, tp):
    """The appendix's formulas: KV B x 2 ceil(K / TPA) Hsz x S / KVP, weights (2 H Q / TPA Hsz +
    2 H ceil(K / TPA) Hsz) + 3 H F / TPF; in Helix the output projection runs over all N, not TPA."""
    layout = Layout.of(kind, nproc, tp=tp)
    b, s, h, q, k, hsz, f = 8, 1_000_000, 128 * 128, 128, 8, 128, 65536
    kv, w = layer_read_bytes(FIGURE_1, layout, 0, s, b, FP4)
    assert kv == b * 2 * math.ceil(k / layout.tp) * hsz * math.ceil(s / layout.kv) * 0.5
    o_ranks = layout.tp if kind == "tp-only" else nproc
    paper_w = h * q // layout.tp * hsz + h * q * hsz / o_ranks + 2 * h * math.ceil(k / layout.tp) * hsz + 3 * h * f / nproc
    assert w == pytest.approx(paper_w * 0.5, rel=1e-12)


def test_figure_1_times():
    """Figure 1's example (as a summary of the paper quotes it): KV read ~128 us a layer at TPA = 8 and
    still ~128 us at TPA = 64 (duplicated), ~16 us with KVP = 8; weights ~30 us at TP 8, ~4 us at TP 64."""
    c = roofline_cluster()
    times = {}
    for name, layout in (("tp8", Layout.of("tp-only", 8)), ("tp64", Layout.of("tp-only", 64)),
                         ("helix", Layout.of("helix", 64, tp=8))):
        kv, w = layer_read_bytes(FIGURE_1, layout, 0, 1_000_000, 8, FP4)
        times[name] = (kv / c.attention_bandwidth * 1e6, w / c.attention_bandwidth * 1e6)
    assert times["tp8"][0] == pytest.approx(128, rel=0.01) and times["tp64"][0] == pytest.approx(128, rel=0.01)
    assert times["helix"][0] == pytest.approx(16, rel=0.01)
    assert times["tp8"][1] == pytest.approx(30, rel=0.02) and times["tp64"][1] == pytest.approx(4, rel=0.05)


def test_weights_per_rank_are_the_layouts_share():
    """Attention projections / tp, everything else / N; tp = N: 1/N of one rank's weights."""
    m = MODELS["llama-3.2-1b"]
    one = weight_bytes_per_rank(m, Layout.of("helix", 1), "q8_0")
    assert one == pytest.approx(m.weight_elements() * 34 / 32)
    assert weight_bytes_per_rank(m, Layout.of("helix", 4, tp=4), "q8_0") == pytest.approx(one / 4)
    qkv = sum(m.qkv_elements(1) for _ in range(m.layers))
    rest = m.weight_elements() - qkv
    assert weight_bytes_per_rank(m, Layout.of("helix", 4, tp=2), "bfloat16") == pytest.approx(2 * (qkv / 2 + rest / 4))
    # today's layout (kvp-only) holds every weight (the tied table too: the embedding reads it whole)
    assert weight_bytes_per_rank(m, Layout.of("kvp-only", 4), "bfloat16") == pytest.approx(2 * m.weight_elements())
    untied = MODELS["llama-3.1-405b"]
    table = untied.vocab * untied.hidden
    assert weight_bytes_per_rank(untied, Layout.of("kvp-only", 4), "bfloat16") == \
        pytest.approx(2 * (untied.weight_elements() - table + table / 4))


def test_kv_per_rank_gqa_duplicates_past_the_kv_heads_and_mla_always():
    m = MODELS["llama-3.1-405b"]
    kv = {n: predict_step(GB200, m, Layout.of("tp-only", n), 100_000).kv_bytes_per_rank for n in (1, 8, 16, 64)}
    assert kv[8] == kv[1] / 8 and kv[16] == kv[8] and kv[64] == kv[8]
    assert predict_step(GB200, m, Layout.of("helix", 64, tp=8), 100_000).kv_bytes_per_rank == pytest.approx(kv[1] / 64, rel=1e-3)
    r1 = MODELS["deepseek-r1"]
    assert r1.kv_elements_per_token(1) == r1.kv_elements_per_token(64) == 512 + 64
    one = predict_step(GB200, r1, Layout.of("tp-only", 1), 100_000).kv_bytes_per_rank
    assert predict_step(GB200, r1, Layout.of("tp-only", 64), 100_000).kv_bytes_per_rank == one
    assert predict_step(GB200, r1, Layout.of("helix", 64), 100_000).kv_bytes_per_rank == pytest.approx(one / 64, rel=1e-3)
    assert helix.helix_tp_choices(r1, 64) == [1]  # the latent is one KV head: TPA = 1


def test_helix_communication_does_not_grow_with_the_sequence():
    m = MODELS["llama-3.1-405b"]
    layout = Layout.of("helix", 64, tp=8)
    short, long = (predict_step(GB200, m, layout, n, batch=4) for n in (128_000, 4_000_000))
    assert short.comm_bytes == long.comm_bytes and short.comm_seconds == long.comm_seconds
    assert long.attention_seconds > 10 * short.attention_seconds


def test_all_to_all_is_alpha_beta():
    c = roofline_cluster(collective_overhead=2e-6)
    cost = collectives.all_to_all(c, 8, 8000)
    assert (cost.rounds, cost.bytes_sent) == (1, 7000)
    assert cost.seconds == pytest.approx(2e-6 + 1e-6 + 7000 / 1e11)
    assert collectives.all_to_all(c, 1, 8000).seconds == 0.0


def test_direct_allreduce_is_the_faster_shot():
    c = roofline_cluster()
    small, large = collectives.direct_allreduce(c, 64, 1000), collectives.direct_allreduce(c, 64, 10**8)
    assert small.algorithm == "one-shot" and small.seconds == pytest.approx(1e-6 + 63 * 1000 / 1e11)
    assert large.algorithm == "two-shot" and large.seconds == pytest.approx(2e-6 + 2 * 63 / 64 * 1e8 / 1e11)


def test_dp_attention_attends_whole_sequences_per_rank():
    m = MODELS["llama-3.1-405b"]
    dp = predict_step(GB200, m, Layout.of("dp-attention", 8), 100_000, batch=16)
    one = predict_step(GB200, m, Layout.of("tp-only", 1), 100_000, batch=2)
    assert dp.kv_bytes_per_rank == one.kv_bytes_per_rank  # 16 sequences over 8 ranks: 2 each, every head


def _point(layout: str, batch: int, seconds: float) -> StepPrediction:
    return StepPrediction(model="m", layout=layout, nproc=1, tp=1, kv=1, seq_len=1, batch=batch, combine="none",
                          weight_bytes_per_rank=0, kv_bytes_per_rank=0, attention_seconds=seconds, weights_seconds=0,
                          comm_seconds=0, predicted_seconds=seconds, comm_bytes=0, fits_memory=True)


def test_compare_reads_ttl_at_fixed_batch_and_batch_at_equal_ttl():
    h = [_point("helix", 1, 1.0), _point("helix", 2, 1.5), _point("helix", 16, 2.0)]
    base = [_point("tp-only", 1, 2.0), _point("tp-only", 2, 6.0)]
    r = helix_paper.compare(h, base, "tp-only")
    assert r.ttl_b1 == 2.0 and r.ttl_max == 4.0
    assert r.batch_max == 16.0  # within 2.0 s: helix reaches 16, the baseline 1
    assert helix_paper.compare(h, [], "kvp-only") == helix_paper.Ratios("kvp-only", None, None, None)


def test_model_ratios_point_the_papers_way():
    """Helix beats the best baseline on time per token and on batch at equal time for both models, and
    gains more over TP-only on MLA (whose latent TP duplicates on every rank) than on GQA."""
    ratios = {name: {r.baseline: r for r in helix_paper.model_ratios(GB200, MODELS[name])}
              for name in ("llama-3.1-405b", "deepseek-r1")}
    for by_baseline in ratios.values():
        assert by_baseline["best baseline"].ttl_b1 > 1 and by_baseline["best baseline"].batch_max > 1
        assert by_baseline["kvp-only"].ttl_b1 is None  # a whole copy of the weights fits no GPU
    assert ratios["deepseek-r1"]["tp-only"].ttl_b1 > ratios["llama-3.1-405b"]["tp-only"].ttl_b1


@pytest.mark.parametrize("call, message", [
    (lambda: Layout.of("ring", 4), "layout must be one of"),
    (lambda: Layout.of("helix", 4, tp=3), "tp (3) must divide nproc (4)"),
    (lambda: Layout.of("helix", 0), "nproc must be an int >= 1"),
    (lambda: predict_step(GB200, MODELS["llama-3.2-1b"], Layout.of("helix", 2), 10, combine="tree"), "combine must be one of"),
    (lambda: predict_step(GB200, MODELS["llama-3.2-1b"], Layout.of("helix", 2), 10, kv_dtype="int3"), "kv_dtype must be one of"),
    (lambda: predict_step(GB200, MODELS["llama-3.2-1b"], Layout.of("helix", 2), 0), "seq_len must be an int >= 1"),
    (lambda: predict_step(GB200, MODELS["smollm2-135m"], Layout.of("tp-only", 2), 10), "tp (2) must divide"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_cli_model_mode_json_and_errors():
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "deepseek-r1", "--preset", "gb200-nvl72", "--nproc", "8",
                                 "-n", "100000", "--batch", "2", "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    assert [r["layout"] for r in records] == list(helix.LAYOUTS)
    assert {r["nproc"] for r in records} == {8} and all(r["preset"] == "gb200-nvl72" for r in records)
    result = runner.invoke(app, ["simulate", "llama-3.2-1b", "--nproc", "4", "--tp", "2", "--layout", "helix",
                                 "--method", "alltoall", "--method", "onepass", "--json"])
    assert [(json.loads(line)["tp"], json.loads(line)["combine"]) for line in result.output.splitlines()] == \
        [(2, "alltoall"), (2, "onepass")]
    for args, message in ((["gpt-5"], "MODEL must be one of"), (["llama-3.2-1b", "--method", "tree"],
                          "--method with MODEL must be one of"), (["llama-3.2-1b", "--layout", "x"], "--layout must be"),
                          (["smollm2-135m", "--nproc", "2"], "--layout tp-only on --nproc 2 (tp 2) must divide")):
        result = runner.invoke(app, ["simulate", *args])
        assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1


def test_doctests_of_the_new_names():
    for module in (helix, helix_paper, collectives):
        failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert tried > 0 and failures == 0, module.__name__
