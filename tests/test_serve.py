"""`treeattn serve` over real sockets, with the official openai client and raw HTTP.

A tiny random Llama is written as a GGUF file with a byte-level tokenizer and a ChatML template
(tests/gguf_files.py). The server runs as `python -m treeattn serve` in its own process with 2
gloo ranks; greedy answers must equal ta.Engine.generate on the same prompts (one in-process
rank: the engine's results do not depend on the rank count, tests/test_engine.py). Faults: a
client that disconnects frees its blocks; SIGTERM drains the running request and leaves no rank
process; a killed rank turns /health to 503 and the server exits non-zero.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from gguf_files import VOCAB  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.models import load_tokenizer  # noqa: E402
from treeattn.models.chat import encode_chat, end_of_turn_id, read_chat_template  # noqa: E402
from helpers.serve import NAME, _write_tiny_llama_gguf, Server, _alive, _metrics, _wait_idle, stream_in_background  # noqa: E402


@pytest.fixture(scope="module")
def model_file(tiny_llama_gguf) -> Path:
    return tiny_llama_gguf  # conftest's: one file for the server tests


@pytest.fixture(scope="module")
def server(tiny_llama_server):
    """conftest's session server (2 ranks, the API key, NAME): shared with tests/test_serve_structured.py; it stops with
    status 0 and leaves no child process at the session's end."""
    return tiny_llama_server


@pytest.fixture(scope="module")
def reference(model_file):
    """Greedy answers of ta.Engine on one in-process rank, and the chat encoding."""
    engine = ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=4096, max_batch_size=8)
    tokenizer, template = load_tokenizer(model_file), read_chat_template(model_file)
    eot = end_of_turn_id(tokenizer, template)

    def complete(prompt, max_tokens, **kw):
        return engine.generate([prompt], max_new_tokens=max_tokens, **kw)[0]

    def chat(messages, max_tokens, **kw):
        ids = encode_chat(tokenizer, template, messages)
        return complete(ids, max_tokens, stop_token_ids=[eot], **kw)

    yield complete, chat
    engine.close()


PROMPTS = ["the cat", "hello there", "a b c d e f", "the theme of the day", "xyz"]


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert server.http(key=None).get("/health").json() == {"status": "ok"}


def test_start_up_steps_and_one_access_line_per_request(server):
    """--log-level info (the default): the start-up's steps, then one line per request with its
    method, path, status, tokens, time to first token and duration -- streamed, refused and
    unauthorized requests too."""
    assert any("starting the engine: 2 rank(s), decode=tree" in line for line in server.lines), server.lines
    assert any(re.search(r"engine ready in \d+\.\d\d s: max context \d+ tokens, KV cache \d+ blocks of 16 tokens", line)
               for line in server.lines)
    assert any(re.search(r"listening on http://127\.0\.0\.1:\d+, \d+\.\d\d s after the start", line) for line in server.lines)
    client = server.client()
    client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    list(client.completions.create(model=NAME, prompt=[5, 6], max_tokens=3, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}))
    server.http(key="wrong").get("/v1/models")
    server.http(key=None).get("/health?x=1")
    server.http().get("/no%22such%0Apath")  # a client's path cannot forge a log line
    patterns = [r'"POST /v1/completions" 200 prompt_tokens=3 completion_tokens=4 ttft=\d+\.\d{3}s duration=\d+\.\d{3}s$',
                r'"POST /v1/completions" 200 prompt_tokens=2 completion_tokens=3 ttft=\d+\.\d{3}s duration=\d+\.\d{3}s$',
                r'"GET /v1/models" 401 duration=\d+\.\d{3}s$', r'127\.0\.0\.1:\d+ "GET /health" 200 duration=\d+\.\d{3}s$',
                r'"GET /no\\x22such\\x0apath" 404 duration=']
    deadline = time.monotonic() + 30  # the lines reach us through a pipe and a thread (a hang guard, not a speed bound)
    while time.monotonic() < deadline:
        access = [line.rstrip("\n") for line in list(server.lines) if "treeattn.serve.access" in line]
        if all(any(re.search(p, line) for line in access) for p in patterns):
            break
        time.sleep(0.1)
    for pattern in patterns:
        assert any(re.search(pattern, line) for line in access), (pattern, access)


@pytest.mark.parametrize("prompt", ["hello there", [5, 6, 7, 8, 9, 10]])
def test_completions_equal_the_engine(server, reference, prompt):
    complete, _ = reference
    expected = complete(prompt, 8)
    response = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.token_ids == expected.token_ids
    assert choice.text == expected.text
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert response.usage.prompt_tokens == expected.prompt_tokens
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_equals_the_engine_and_ends_with_done(server, reference):
    complete, _ = reference
    expected = complete("the cat", 10)
    chunks = list(server.client().completions.create(model=NAME, prompt="the cat", max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason is not None
    with server.http().stream("POST", "/v1/completions", json={"model": NAME, "prompt": "the cat", "max_tokens": 3,
                                                               "temperature": 0, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_chat_completions_stream_and_not_equal_the_engine(server, reference):
    _, chat = reference
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the theme?"}]
    expected = chat(messages, 12)
    client = server.client()
    response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n_choices_share_the_prompt(server, reference):
    complete, _ = reference
    long_prompt = "the theme " * 12  # more than one 16-token block
    expected = complete(long_prompt, 6)
    hits_before = _metrics(server)["treeattn_prefix_cache_hit_tokens_total"]
    response = server.client().completions.create(model=NAME, prompt=long_prompt, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.token_ids == expected.token_ids for c in response.choices)
    assert response.usage.completion_tokens == 3 * len(expected.token_ids)
    assert _metrics(server)["treeattn_prefix_cache_hit_tokens_total"] > hits_before
    sampled = server.client().completions.create(model=NAME, prompt="xyz", max_tokens=8, temperature=1.0, seed=3, n=4)
    assert len({tuple(c.token_ids) for c in sampled.choices}) > 1  # different seeds per choice


def test_logprobs_over_the_openai_client(server, reference):
    """completions' logprobs=k and chat's logprobs/top_logprobs, plain and streamed, carry the
    engine's per-token log-probabilities (2 ranks here, 1 in the reference: equal up to rounding)."""
    complete, chat = reference
    client = server.client()
    expected = complete("the cat", 6, logprobs=2)
    lp = client.completions.create(model=NAME, prompt="the cat", max_tokens=6, temperature=0, logprobs=2).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    for top, e in zip(lp.top_logprobs, expected.logprobs, strict=True):  # keyed by token text: two bytes may both be U+FFFD
        assert 1 <= len(top) <= 2 and all(min(abs(v - w) for _, w in e.top) < 1e-4 for v in top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = client.completions.create(model=NAME, prompt="the cat", max_tokens=6, temperature=0, logprobs=2, stream=True)
    # the repeated prompt hits the prefix cache, so its logits come from a step of other shapes: float32 rounding
    assert [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        lp.token_logprobs, abs=1e-4)

    messages = [{"role": "user", "content": "the theme?"}]
    expected = chat(messages, 8, logprobs=2)
    content = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                             top_logprobs=2).choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                            stream=True)
    streamed = [c.logprob for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    bad = server.http().post("/v1/chat/completions", json={"model": NAME, "messages": messages, "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


BAD_REQUESTS = [
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2, VOCAB + 5]}, 400, "prompt"),
    ({"prompt": list(range(3, 250)) * 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "echo": True, "stream": True}, 400, "echo"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
]


@pytest.mark.parametrize("body, status, param", BAD_REQUESTS)
def test_bad_completion_requests_name_the_field(server, body, status, param):
    response = server.http().post("/v1/completions", json={"model": NAME, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_bad_chat_requests_malformed_json_and_auth(server):
    http = server.http()
    for messages in ([], [{"role": "user"}], [{"role": "wizard", "content": "hi"}]):
        response = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages"), response.text
    response = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    for key in (None, "wrong"):
        response = server.http(key=key).post("/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert server.http(key=key).get("/v1/models").status_code == 401
    assert server.client().completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).choices  # still serving


def test_a_client_that_disconnects_frees_its_blocks(server):
    with server.http().stream("POST", "/v1/completions", json={"model": NAME, "prompt": "the cat " * 20, "max_tokens": 300,
                                                               "temperature": 0, "stream": True}) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    m = _wait_idle(server)
    assert m["treeattn_requests_running"] == 0
    assert m['treeattn_kv_blocks{state="used"}'] == m['treeattn_kv_blocks{state="cached"}']


def test_32_concurrent_streaming_clients(server, reference):
    complete, _ = reference
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    expected = [complete(p, 6).text for p in prompts]
    client = server.client()

    def run(prompt):
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in stream)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, prompts))
    assert got == expected
    m = _wait_idle(server)
    assert m["treeattn_requests_running"] == 0
    assert m['treeattn_kv_blocks{state="used"}'] == m['treeattn_kv_blocks{state="cached"}']
    assert m['treeattn_requests_total{endpoint="/v1/completions",status="200"}'] >= 32


def test_sigterm_drains_the_running_request_and_a_full_queue_answers_429(model_file):
    srv = Server(model_file, "--nproc", "2", "--max-pending", "2")
    try:
        never = srv.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "n": 3})  # can never be admitted
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
        reader, lines, started = stream_in_background(srv)
        assert started.wait(60)
        too_many = srv.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "n": 2})  # 1 + 2 > 2 in flight
        assert too_many.status_code == 429 and too_many.json()["error"]["type"] == "rate_limit_error"
        srv.process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert srv.process.wait(timeout=60) == 0
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 150  # every token was generated and sent
        time.sleep(0.5)
        assert _alive(srv.children) == []
    finally:
        srv.stop()


def test_a_dead_rank_turns_health_to_503_and_the_server_exits_nonzero(model_file):
    """The server stops within half a second of the engine turning unhealthy, so a poll may or may
    not land in the window where /health says 503 (on a busy machine it often does not): what must
    hold is that once /health has said 503 it never says 200 again, that the server says why it
    stops, exits non-zero and leaves no rank behind."""
    srv = Server(model_file, "--nproc", "2", "--timeout", "10")
    try:
        # the ranks: forked from the server (StartedRanks), so they share its command line; not multiprocessing's resource tracker
        ranks = [pid for pid in srv.children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
        assert ranks, "no rank process found"
        os.kill(ranks[-1], signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and srv.process.poll() is None:
            try:
                statuses.append(srv.http().get("/health").status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert srv.process.wait(timeout=5) != 0
        assert set(statuses) <= {200, 503}, statuses
        if 503 in statuses:
            assert 200 not in statuses[statuses.index(503):], statuses
        assert any("stopping the server" in line for line in srv.lines), srv.lines[-5:]
        time.sleep(0.5)
        assert _alive(srv.children) == []
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def draft_file(tmp_path_factory) -> Path:
    """A smaller random model (one layer, other head sizes) with the model's tokenizer: a draft."""
    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("serve_draft") / "draft.gguf", 1, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_speculative_decoding_serves_the_same_tokens_and_counts_drafts(model_file, reference, request, speculate):
    """`--speculate ngram` (prompt lookup) or `--speculate draft --draft-model PATH` (another shape,
    loaded on both ranks), `--draft-tokens 3`, on 2 ranks: greedy completions, plain and streamed,
    equal the engine's without speculation; /metrics counts the drafts."""
    complete, _ = reference
    extra = ["--draft-model", str(request.getfixturevalue("draft_file"))] if speculate == "draft" else []
    srv = Server(model_file, "--nproc", "2", "--speculate", speculate, *extra, "--draft-tokens", "3", "--served-model-name", NAME)
    try:
        client = srv.client()
        prompts = ["the cat sat on the mat and the cat sat on the", "a b c d a b c d a b", "xyz"]
        for prompt in prompts:
            response = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
            assert response.choices[0].token_ids == complete(prompt, 16).token_ids
        stream = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=16, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == complete(prompts[0], 16).text
        m = _wait_idle(srv)
        drafted, accepted = m["treeattn_spec_decode_draft_tokens_total"], m["treeattn_spec_decode_accepted_tokens_total"]
        assert drafted > 0 and 0 <= accepted <= drafted
        assert m["treeattn_decode_tokens_per_forward"] >= 1
    finally:
        assert srv.stop() == 0


def test_decode_step_graph_is_refused_on_cpu_in_one_line(model_file):
    """`--decode-step` reaches the engine (whose static steps tests/test_engine_static_step.py checks):
    graph steps need a CUDA model, so on the CPU the server fails at start with one line."""
    refused = subprocess.run([sys.executable, "-m", "treeattn", "serve", str(model_file), "--decode-step", "graph",
                              "--log-level", "warning"], capture_output=True, text=True, timeout=120)  # no start-up INFO lines
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == ["treeattn serve: error: --decode-step graph records CUDA graphs: the model "
                                                   "must be "
                                                   "on a CUDA device, got cpu (--decode-step static runs the same steps without "
                                                   "graphs)"]


def test_the_engine_starts_while_the_web_stack_is_imported_and_its_failures_come_back():
    """serve builds ta.Engine in a thread while it imports uvicorn and FastAPI (so the ranks start
    during the imports): the engine comes back ready; the engine's own error is raised in the
    caller's thread (one line at the command, as the test above checks end to end); an import that
    fails closes the engine it started."""
    import treeattn.engine
    import treeattn.serve.server as server_module
    from treeattn.engine.config import ConfigError
    from treeattn.models.llama import LlamaConfig, random_model

    model = random_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                     num_kv_heads=1,
                                     head_dim=16, max_position_embeddings=128))
    options = dict(nproc=1, block_size=16, cache_tokens=128)
    engine = server_module._started_engine(model, options)
    try:
        assert engine.healthy and engine.max_context == 128
    finally:
        engine.close()

    with pytest.raises(ConfigError, match="decode_step='graph'"):
        server_module._started_engine(model, dict(options, decode_step="graph"))

    built = []

    class Recorded(treeattn.engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    def broken_import():
        raise ImportError("no web stack")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(treeattn.engine, "Engine", Recorded)
        patch.setattr(server_module, "_import_web_stack", broken_import)
        with pytest.raises(ImportError, match="no web stack"):
            server_module._started_engine(model, options)
    assert len(built) == 1 and not built[0].healthy and built[0]._closed
