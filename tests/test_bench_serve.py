"""`treeattn bench serve` (treeattn.bench.serving) against a real `treeattn serve` of a tiny model.

Open loop at a fixed concurrency and at a Poisson rate: every request completes, the token counts are
the server's (`usage`), each request's inter-token latencies number at most its tokens - 1 (one per
streamed chunk, tokens of one character sharing one), the percentiles are numpy's over the per-request lists, goodput counts the
requests within the SLOs, and the JSON has `vllm bench serve`'s keys. Statistics of the arrival
times: Poisson and constant schedules have the asked mean rate (a seeded draw). No timing is checked.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("httpx")

from helpers.serve import NAME, Server, _write_tiny_llama_gguf  # noqa: E402

from treeattn.bench.serving import ServeBenchConfig, arrival_times, parse_goodput, run_serve_benchmark  # noqa: E402

VLLM_KEYS = {"date", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
             "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = _write_tiny_llama_gguf(tmp_path_factory.mktemp("bench_serve") / f"{NAME}.gguf", 0, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    srv = Server(model, "--nproc", "1", "--served-model-name", NAME)
    yield srv
    assert srv.stop() == 0


def test_fixed_concurrency_and_poisson_runs_report_vllms_keys(server):
    for extra in ({"max_concurrency": 2}, {"request_rate": 20.0, "arrival": "poisson"}):
        config = ServeBenchConfig(base_url=server.url, num_prompts=6, input_len=8, output_len=5, range_ratio=0.5,
                                  max_token_id=250, goodput={"ttft": 1e9, "e2el": 1e-6}, **extra)
        result = run_serve_benchmark(config)
        assert VLLM_KEYS <= set(result), VLLM_KEYS - set(result)
        assert result["completed"] == 6 and result["failed"] == 0 and result["model_id"] == NAME
        assert result["total_input_tokens"] == sum(result["input_lens"]) and all(4 <= n <= 12 for n in result["input_lens"])
        assert result["total_output_tokens"] == sum(result["output_lens"])
        # one gap per streamed chunk after the first: a token that ends inside a UTF-8 character comes with the next
        assert all(len(itl) <= n - 1 for itl, n in zip(result["itls"], result["output_lens"])) and any(result["itls"])
        assert result["request_goodput"] == 0.0  # no request ends within 1 ns
        itl_ms = np.array([x for row in result["itls"] for x in row]) * 1000
        assert result["p90_itl_ms"] == pytest.approx(np.percentile(itl_ms, 90))
        assert result["median_ttft_ms"] == pytest.approx(np.median(result["ttfts"]) * 1000)
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
        assert result["request_throughput"] == pytest.approx(6 / result["duration"])


def test_the_command_writes_the_json_and_goodput(server, tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "treeattn", "bench", "serve", "--base-url", server.url, "--num-prompts", "4",
                          "--input-len", "6", "--output-len", "3", "--max-token-id", "250", "--max-concurrency", "4",
                          "--goodput", "ttft:100000000", "--result-file", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "P99 ITL (ms):" in run.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["request_goodput"] == pytest.approx(4 / result["duration"])
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 4


def test_extra_body_and_text_prompts_from_a_file(server, tmp_path):
    """--extra-body reaches every request (a logit_bias of 100 forces token 120, "u", without ignore_eos);
    a .jsonl prompt's prompt_len is kept where the server's usage gives none (ours gives it)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": "the cat", "prompt_len": 99, "output_len": 4}) for _ in range(3)) + "\n")
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "treeattn", "bench", "serve", "--base-url", server.url, "--dataset-path",
                          str(prompts),
                          "--num-prompts", "3", "--no-ignore-eos", "--extra-body", '{"logit_bias": {"120": 100}}',
                          "--result-file", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["output_lens"] == [4, 4, 4] and result["generated_texts"] == ["uuuu"] * 3
    assert all(n != 99 for n in result["input_lens"])  # the server's usage wins
    bad = subprocess.run([sys.executable, "-m", "treeattn", "bench", "serve", "--base-url", server.url, "--extra-body", "[1]"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--extra-body must be a JSON object" in bad.stderr


def test_arrival_schedules_have_the_asked_rate():
    poisson = arrival_times(ServeBenchConfig(base_url="http://x", request_rate=4.0, seed=1), 4001)
    assert poisson[0] == 0 and all(b >= a for a, b in zip(poisson, poisson[1:]))
    assert 4000 / poisson[-1] == pytest.approx(4.0, rel=0.1)  # a seeded draw: fixed
    constant = arrival_times(ServeBenchConfig(base_url="http://x", request_rate=4.0, arrival="constant"), 5)
    assert constant == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert arrival_times(ServeBenchConfig(base_url="http://x"), 3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"request_rate": -1}, "request_rate must be a number > 0"), ({"arrival": "burst"},
                                                                  "arrival must be 'poisson' or 'constant'"),
    ({"max_concurrency": 0}, "max_concurrency must be None or an int >= 1"), ({"base_url": "localhost:8000"}, "base_url must be"),
    ({"goodput": {"ttl": 5}}, "goodput must be a dict"),
])
def test_bad_config_is_one_line_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        ServeBenchConfig(**{"base_url": "http://x", **kwargs})


def test_goodput_parsing():
    assert parse_goodput("ttft:500 tpot:50,e2el:1e4") == {"ttft": 500.0, "tpot": 50.0, "e2el": 1e4}
    with pytest.raises(ValueError, match="goodput: each item must be NAME:MILLISECONDS"):
        parse_goodput("itl:5")
    assert math.isinf(ServeBenchConfig(base_url="http://x").request_rate)


def test_the_serving_module_examples_run():
    import doctest

    import treeattn.bench.serving as serving

    assert doctest.testmod(serving).failed == 0
