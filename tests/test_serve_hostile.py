"""`treeattn serve` under a hostile client (issue 24), over real sockets: the official openai
client, httpx and raw sockets against one 2-rank server of the tiny GGUF model of test_serve.py.

Its chat template is ChatML with traps that only some messages spring (a loop of 10^10 steps, a
macro that recurses for ever, a TypeError): the server must answer each with one 400 naming the
template, and go on serving. A property test throws random bodies at the server and checks that it
still answers /health and a good request, that nothing runs or is held, and that /metrics stays
small. docs/faults.md lists what each test checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gguf
import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")

from gguf_files import CHATML, VOCAB, write_gguf  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers.serve import KEY, NAME, Server, _alive, _metrics, _wait_idle, stream_in_background  # noqa: E402
from treeattn.serve.protocol import MAX_BATCH_PROMPTS  # noqa: E402

MAX_PENDING = 8
MAX_BYTES = 64 * 1024
TRAPS = ("{% for message in messages %}"
         "{% if message['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
         "{% endfor %}{% endif %}"
         "{% if message['content'] == 'type' %}{{ 1 + message['content'] }}{% endif %}"
         "{% if message['content'] == 'recurse' %}{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}{% endif %}"
         "{% endfor %}")


def _write_model(path: Path, template: str) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                      initializer_range=0.1, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_gguf(path, transformers.LlamaForCausalLM(config).eval(), gguf.GGMLQuantizationType.F16, context_length=512,
               chat_template=template)
    return path


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return _write_model(tmp_path_factory.mktemp("hostile") / f"{NAME}.gguf", TRAPS + CHATML)


@pytest.fixture(scope="module")
def server(model_file):
    srv = Server(model_file, "--nproc", "2", "--api-key", KEY, "--served-model-name", NAME, "--max-pending", str(MAX_PENDING),
                 "--max-request-bytes", str(MAX_BYTES), "--body-timeout", "2")
    yield srv
    assert srv.stop() == 0
    time.sleep(0.5)
    assert _alive(srv.children) == []


def _post(server: Server, path: str, body, **kw) -> httpx.Response:
    return server.http().post(path, json=body, **kw) if not isinstance(body, bytes) else server.http().post(
        path, content=body, headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    """An OpenAI error body with `status`, no traceback, no file path."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert "Traceback" not in response.text and ".py" not in response.text and "/tmp" not in response.text, response.text
    if param != "any":
        assert error["param"] == param, error
    return error


def _server_running_nothing(server: Server) -> dict[str, float]:
    m = _wait_idle(server)
    assert m["treeattn_requests_running"] == 0 and m["treeattn_requests_waiting"] == 0
    assert m['treeattn_kv_blocks{state="used"}'] == m['treeattn_kv_blocks{state="cached"}']
    return m


# ------------------------------------------------------------------------- 1, 6: sampling fields


def test_a_seed_beyond_2_64_is_400_naming_seed_and_the_engine_lives(server):
    for body in ({"seed": 2**64}, {"seed": 2**64 - 1, "n": 2}):  # choice i uses seed + i
        _assert_openai_error(_post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, **body}), 400,
                             "seed")
    assert server.http(key=None).get("/health").json() == {"status": "ok"}
    last = server.client().completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0.5, seed=2**64 - 1)
    assert len(last.choices[0].token_ids) == 2


def test_a_tiny_temperature_or_top_p_answers_as_greedy(server):
    client = server.client()
    greedy = client.completions.create(model=NAME, prompt="the cat", max_tokens=12, temperature=0).choices[0].token_ids
    for sampling in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-50, "temperature": 1.0}):
        got = client.completions.create(model=NAME, prompt="the cat", max_tokens=12, seed=1, **sampling).choices[0].token_ids
        assert got == greedy, sampling


# ------------------------------------------------------------------------- 5: stop strings


def test_stop_strings_spanning_tokens_cut_the_text_right_before_them_streamed_or_not(server):
    client = server.client()
    full = client.completions.create(model=NAME, prompt="the cat", max_tokens=40, temperature=0).choices[0].text
    where = next(k for k in range(1, len(full) - 3) if "\ufffd" not in full[k:k + 3] and full.find(full[k:k + 3]) == k)
    stop = full[where:where + 3]  # 3 byte-level tokens
    choice = client.completions.create(model=NAME, prompt="the cat", max_tokens=40, temperature=0, stop=[stop]).choices[0]
    assert (choice.text, choice.finish_reason) == (full[:where], "stop")
    chunks = list(client.completions.create(model=NAME, prompt="the cat", max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:where] and chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------- 8: sockets


def test_every_listening_socket_of_the_server_and_its_ranks_is_on_the_loopback(server):
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")
    pids = {server.process.pid, *_alive(server.children)}
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [line for line in lines if any(f"pid={pid}," in line for pid in pids)]
    assert len(ours) >= 2, lines  # at least the HTTP port and the rendezvous store
    for line in ours:
        local = line.split()[3]
        assert local.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"), line


# ------------------------------------------------------------------------- 9, 13: routes, errors, metrics


def test_random_paths_do_not_grow_metrics_and_every_error_has_openai_shape(server):
    before = server.http().get("/metrics").text
    with server.http(key=None) as keyless, server.http() as keyed:
        for i in range(100):
            path = f"/random/{i}/{os.urandom(4).hex()}"
            _assert_openai_error(keyless.get(path), 401)
            _assert_openai_error(keyed.get(path), 404)
            _assert_openai_error(keyed.post(f"/v1/{i}", json={}), 404)
    after = server.http().get("/metrics").text
    assert len(after.splitlines()) - len(before.splitlines()) <= 4 * 2  # at most 2 new (route, status) series, 4 lines each
    assert 'endpoint="unmatched",status="404"' in after and 'endpoint="unmatched",status="401"' in after
    assert "/random/" not in after
    _assert_openai_error(server.http().delete("/v1/models"), 405)
    assert server.http(key=None).head("/health").status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"model": NAME, "prompt": "\ud800"}, "prompt"),
    ({"model": NAME, "prompt": ["ok", "a\udfff"]}, "prompt"),
    ({"model": NAME, "prompt": "hi", "stop": ["\ud800"]}, "stop"),
    ({"model": "\ud800", "prompt": "hi"}, "model"),
    ({"model": NAME, "prompt": "hi", "extra": {"\ud800": 1}}, "extra"),  # in a key of a field the server ignores
])
def test_a_lone_surrogate_is_400_naming_the_field(server, body, param):
    raw = json.dumps(body).encode()  # json escapes it: "\ud800"
    error = _assert_openai_error(_post(server, "/v1/completions", raw), 400, param)
    assert "surrogate" in error["message"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x\ud800"}]}
    _assert_openai_error(_post(server, "/v1/chat/completions", json.dumps(chat).encode()), 400, "messages")


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "\xff\xfe"}', b"[" * 20_000 + b"]" * 20_000,
                                 b'{"model": "tiny", "prompt": ', b"\x00\x01"], ids=["not-utf8", "deep", "cut", "binary"])
def test_bodies_that_are_not_json_are_400_in_openai_shape(server, raw):
    _assert_openai_error(_post(server, "/v1/completions", raw), 400)


def test_prompt_tokens_are_counted_once_per_prompt(server):
    name = "treeattn_prompt_tokens_total"
    before = _metrics(server)[name]
    response = server.client().completions.create(model=NAME, prompt="the theme of the day", max_tokens=3, n=4,
                                                  temperature=1.0, seed=0)
    assert len(response.choices) == 4
    assert _metrics(server)[name] - before == response.usage.prompt_tokens > 0


# ------------------------------------------------------------------------- 10: limits


def test_limits_refuse_before_any_work(server):
    http = server.http()
    too_big = {"model": NAME, "prompt": "a" * MAX_BYTES}
    error = _assert_openai_error(http.post("/v1/completions", json=too_big), 413)
    assert str(MAX_BYTES) in error["message"]
    chunked = http.post("/v1/completions", content=iter([json.dumps(too_big).encode()[i:i + 4096]
                                                         for i in range(0, MAX_BYTES + 100, 4096)]),
                        headers={"Content-Type": "application/json"})  # no Content-Length: counted as it comes
    _assert_openai_error(chunked, 413)
    # n alone, or prompts x n, above --max-pending can never be admitted: 400 (429 is for "retry later")
    error = _assert_openai_error(http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "n": MAX_PENDING + 1}), 400,
                                 "n")
    assert f"at most {MAX_PENDING}" in error["message"]
    _assert_openai_error(http.post("/v1/completions", json={"model": NAME, "prompt": ["hi"] * (MAX_PENDING + 1)}), 400, "prompt")
    _assert_openai_error(http.post("/v1/completions", json={"model": NAME, "prompt": [[5]] * 3, "n": 3}), 400, "prompt")
    # a batch beyond MAX_BATCH_PROMPTS is refused before its items are validated one by one
    for batch in (["a"] * (MAX_BATCH_PROMPTS + 1), [[1]] * (MAX_BATCH_PROMPTS + 1)):  # within the test's body limit
        error = _assert_openai_error(http.post("/v1/completions", json={"model": NAME, "prompt": batch}), 400, "prompt")
        assert f"at most {MAX_BATCH_PROMPTS} prompts, got {MAX_BATCH_PROMPTS + 1}" in error["message"]
    # a text that no tokenization can fit in the context is refused untokenized, naming the context
    error = _assert_openai_error(http.post("/v1/completions", json={"model": NAME, "prompt": "ab" * 30_000}), 400, "prompt")
    assert "characters" in error["message"]
    _server_running_nothing(server)


# ------------------------------------------------------------------------- 12: timeouts


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_headers_without_body_get_408_and_silent_connections_are_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n{")
        answer = _read_all(sock)  # ends: the server closes the connection
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer
    with _connect(server) as sock:  # nothing at all
        assert _read_all(sock) == b""
    with _connect(server) as sock:  # headers never finished
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _read_all(sock) == b""
    assert server.http(key=None).get("/health").status_code == 200


# ------------------------------------------------------------------------- 4: chat templates


@pytest.mark.parametrize("trap, what", [("loop", "steps"), ("type", "TypeError"), ("recurse", "RecursionError")])
def test_a_failing_chat_template_is_one_400_naming_it(server, trap, what):
    response = server.http().post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": trap}]})
    error = _assert_openai_error(response, 400, "messages")
    assert (
        error["message"].startswith(f"the model's chat template ({NAME}.gguf:tokenizer.chat_template): ")
        and what in error["message"]
    )
    answer = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].message.role == "assistant"


def test_a_template_that_never_ends_fails_the_start_up_in_one_line(tmp_path):
    model = _write_model(tmp_path / "loops.gguf",
                         "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    done = subprocess.run([sys.executable, "-m", "treeattn", "serve", str(model), "--nproc", "2", "--port", "0"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treeattn serve: error: ") and "loops.gguf:tokenizer.chat_template" in lines[0]
    assert "more than" in lines[0] and "steps" in lines[0]


# ------------------------------------------------------------------------- 7: disconnects


def test_a_client_that_goes_away_cancels_its_request_streamed_or_not(server):
    """(Greedy "the cat" runs 500 tokens without an end-of-sequence: test_serve.py's SIGTERM test.)"""
    before = _metrics(server)
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 500, "temperature": 0}
    with _connect(server) as sock:  # not streamed: the client closes its socket while the request runs
        raw = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw
        )
        while _metrics(server)["treeattn_requests_running"] == 0:
            time.sleep(0.05)
    with server.http().stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    m = _server_running_nothing(server)
    cancelled = 'treeattn_requests_cancelled_total{endpoint="/v1/completions"}'
    assert m[cancelled] - before.get(cancelled, 0) == 2
    status = 'treeattn_requests_total{endpoint="/v1/completions",status="499"}'
    assert m[status] - before.get(status, 0) == 1  # the non-streamed one (the streamed one was answered 200)
    generated = m["treeattn_generation_tokens_total"] - before["treeattn_generation_tokens_total"]
    assert generated == 0  # cancelled choices are not counted as finished ones


# ------------------------------------------------------------------------- the property test


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([NAME, "gpt-4", ""]) | st.text(max_size=5),
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, VOCAB + 5), max_size=8) | st.lists(st.text(max_size=6),
                                                                                                 max_size=4) | _json,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard"]),
                                                "content": st.sampled_from(["hi", "loop", "type", "recurse",
                                                                            ""]) | st.text(max_size=10)}),
                         max_size=3) | _json,
    "max_tokens": st.integers(-2, 600) | _json, "temperature": st.floats(allow_nan=True) | _json,
    "top_p": st.floats(allow_nan=True) | _json, "top_k": st.integers(-2, 10**6) | _json,
    "seed": st.integers(-2, 2**65) | _json, "n": st.integers(-1, 12), "stop": st.text(max_size=4) | _json,
    "logprobs": st.integers(-2, 30) | st.booleans() | _json, "top_logprobs": st.integers(-2, 30) | _json,
    "stream": st.booleans() | _json, "echo": _json,
})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=_fields,
       max_tokens=st.integers(1, 3), raw=st.binary(max_size=64) | st.none())
def test_random_bodies_never_break_the_server(server, path, body, max_tokens, raw):
    """Whatever the body: an OpenAI error or an answer, never a 500; afterwards /health is ok, a good
    request is served, nothing runs or is held, /metrics stays small."""
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = max_tokens  # keep the examples quick: a few tokens at most
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    with server.http() as http:
        if body.get("stream") is True and raw is None:
            with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
                text = "".join(response.iter_text())
            assert response.status_code < 500, text
            if response.status_code == 200:
                assert text.rstrip().endswith("data: [DONE]") and "Traceback" not in text
        else:
            response = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert response.status_code < 500, response.text
            if response.status_code != 200:
                _assert_openai_error(response, response.status_code)
    assert server.http(key=None).get("/health").json() == {"status": "ok"}


def test_after_the_random_bodies_the_server_is_whole(server):
    """Runs after the property test (pytest keeps the file's order)."""
    assert server.client().completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).choices[0].token_ids
    _server_running_nothing(server)
    assert len(server.http().get("/metrics").content) < 64 * 1024
    text = server.http().get("/metrics").text
    assert not re.search(r'status="5\d\d"', text), [line for line in text.splitlines() if 'status="5' in line]


# ------------------------------------------------------------------------- 11: Ctrl-C (ends the module's server)


def test_ctrl_c_drains_like_sigterm(server):
    """SIGINT to the server and its ranks at once (what Ctrl-C in a terminal does to the process
    group): the ranks ignore it, the server stops accepting, lets the running stream finish and
    exits 0. The last test of the module: the server is gone afterwards."""
    reader, lines, started = stream_in_background(server)
    assert started.wait(120)
    for pid in [server.process.pid, *_alive(server.children)]:
        os.kill(pid, signal.SIGINT)
    reader.join(120)
    assert server.process.wait(timeout=120) == 0, "".join(server.lines[-20:])
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 150 and "error" not in chunks[-2]
