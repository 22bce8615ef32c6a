"""`treeattn serve` over real sockets (issue 49): the sampling controls clients send, the chat
template's options, what is refused by name, and the third hostile pass's findings.

One 1-rank server of the tiny GGUF model of test_serve.py (its key read from --api-key-file) answers
the sampling and protocol tests; greedy answers with penalties and logit_bias equal ta.Engine's with
the same SamplingParams. Two 2-rank servers have a rank SIGKILLed: idle, the engine fails, /health
and the API answer 503 and the log names the rank, its pid and the signal; during a step, the
step's request gets a 503 naming the rank and the server goes on with new ranks. docs/faults.md
lists what each test checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from helpers.serve import KEY, NAME, Server, _alive, _children, _write_tiny_llama_gguf  # noqa: E402

import treeattn as ta  # noqa: E402
from treeattn.models import load_tokenizer  # noqa: E402
from treeattn.models.chat import end_of_turn_id, read_chat_template  # noqa: E402


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return _write_tiny_llama_gguf(tmp_path_factory.mktemp("controls") / f"{NAME}.gguf", 0, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def server(model_file, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    srv = Server(model_file, "--nproc", "1", "--api-key-file", str(key_file), "--served-model-name", NAME)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def engine(model_file):
    with ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=4096, max_batch_size=8) as engine:
        yield engine


def _error(response: httpx.Response, status: int, param="any") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param != "any":
        assert error["param"] == param, error
    return error


# ------------------------------------------------------------------------- sampling controls


PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}


def test_penalties_and_logit_bias_give_the_engines_greedy_tokens(server, engine):
    client = server.client()
    prompt = [5, 6, 7, 8, 9, 10]
    for extra in ({}, PENALTIES, {**PENALTIES, "logit_bias": {"100": 2.0, "101": -1.5}}, {"min_p": 0.3}):
        body = {k: v for k, v in extra.items() if k not in ("repetition_penalty", "min_p")}
        vllm = {k: v for k, v in extra.items() if k in ("repetition_penalty", "min_p")}
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, **body,
                                        extra_body={"ignore_eos": True, **vllm}).choices[0].token_ids
        bias = {int(k): v for k, v in extra.get("logit_bias", {}).items()}
        params = ta.SamplingParams(max_new_tokens=10, ignore_eos=True, **{**extra, "logit_bias": bias})
        assert got == engine.generate([prompt], params)[0].token_ids, extra
    plain = engine.generate([prompt], max_new_tokens=10, ignore_eos=True)[0].token_ids
    penalized = engine.generate([prompt], ta.SamplingParams(max_new_tokens=10, ignore_eos=True, **PENALTIES))[0].token_ids
    assert plain != penalized  # the penalties change this answer


def test_a_logit_bias_of_100_forces_its_token_in_completions_and_chat(server):
    client = server.client()
    text = client.completions.create(model=NAME, prompt="the cat", max_tokens=5, temperature=0.9, seed=3,
                                     logit_bias={"120": 100}, extra_body={"ignore_eos": True})
    assert text.choices[0].token_ids == [120] * 5
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"120": 100})
    assert chat.id.startswith("chatcmpl-") and text.id.startswith("cmpl-")
    assert chat.choices[0].token_ids == [120] * 4


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"best_of": 2}, "best_of"), ({"tools": [{"type": "function"}]}, "tools"), ({"min_tokens": 3}, "min_tokens"),
    ({"no_such_field": 1}, "no_such_field"), ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_or_unsupported_fields_are_400_naming_them(server, body, param):
    response = server.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **body})
    _error(response, 400, param)


def test_no_op_values_of_unsupported_fields_are_taken(server):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "best_of": 1, "echo": False, "tools": [], "min_tokens": 0,
            "skip_special_tokens": True, "user": "u", "logit_bias": {}}
    assert server.http().post("/v1/completions", json=body).status_code == 200


# ------------------------------------------------------------------------- chat template options


def _chat(server, **extra) -> httpx.Response:
    body = {"model": NAME, "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": "say the cat"}, {"role": "assistant", "content": "the c"}], **extra}
    return server.http().post("/v1/chat/completions", json=body)


def test_chat_template_options_render_as_asked(server, engine, model_file):
    tokenizer, template = load_tokenizer(model_file), read_chat_template(model_file)
    eot = end_of_turn_id(tokenizer, template)
    messages = [{"role": "user", "content": "say the cat"}, {"role": "assistant", "content": "the c"}]
    without = template.render(messages, add_generation_prompt=False)
    continued = without[: without.rfind("the c") + len("the c")]
    for extra, text in (({"add_generation_prompt": False}, without),
                        ({"add_generation_prompt": False, "continue_final_message": True}, continued),
                        ({}, template.render(messages)), ({"chat_template_kwargs": {"enable_thinking": False}},
                                                          template.render(messages))):
        response = _chat(server, **extra)
        assert response.status_code == 200, response.text
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        expected = engine.generate([ids], max_new_tokens=6, stop_token_ids=[eot])[0]
        assert response.json()["choices"][0]["token_ids"] == expected.token_ids, extra


@pytest.mark.parametrize("extra, param", [
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt (true by default)
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"tool_choice": "required"}, "tool_choice"),  # "auto" without tools is taken (no call can be made)
])
def test_chat_options_it_cannot_honour_are_400_naming_them(server, extra, param):
    _error(_chat(server, **extra), 400, param)


# ------------------------------------------------------------------------- fix 1: chat bodies bounded


def test_a_4_mb_chat_body_is_refused_before_tokenizing(server):
    big = "a" * (3_900_000)
    response = server.http().post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": big}]})
    error = _error(response, 400, "messages")
    assert re.search(r"the messages hold 3900000 characters, more than \d+ tokens", error["message"]), error
    parts = [{"type": "text", "text": "b" * 1_000_000}] * 3
    _error(server.http().post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": parts}]}),
           400, "messages")
    assert server.http(key=None).get("/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------- fix 5: echoes and unclear errors


def test_a_huge_model_name_is_not_echoed(server):
    response = server.http().post("/v1/completions", json={"model": "m" * 3_000_000, "prompt": "hi"})
    error = _error(response, 404, "model")
    assert len(response.content) < 1000 and "m" * 80 + "..." in error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"model": NAME, "prompt": [1.5]}, "prompt", "expected a string, a list of token ids"),
    ({"model": NAME, "prompt": "hi", "stop": 5}, "stop", "expected a string, a list of strings"),
    ({"model": NAME, "prompt": {"a": 1}}, "prompt", "expected a string"),
])
def test_union_fields_are_named_without_pydantics_branch(server, body, param, words):
    error = _error(server.http().post("/v1/completions", json=body), 400, param)
    assert words in error["message"], error


def test_a_body_that_is_not_an_object_or_not_json_says_so(server):
    for content, kind in ((b"[1, 2]", "application/json"), (b'"hi"', "application/json"),
                          (b'{"model": "tiny", "prompt": "hi"}', "text/plain")):
        response = server.http().post("/v1/completions", content=content, headers={"Content-Type": kind})
        error = _error(response, 400)
        assert error["message"].startswith("the body must be a JSON object sent with 'Content-Type: application/json'"), error
        assert "None" not in error["message"]


def test_a_text_part_without_text_says_so(server):
    for part, words in (({"type": "text"}, "a text part needs a string 'text', got None"),
                        ({"type": "text", "text": 5}, "a text part needs a string 'text', got 5"),
                        ({"type": "image_url"}, "only text content parts are supported, got type 'image_url'")):
        body = {"model": NAME, "messages": [{"role": "user", "content": [part]}]}
        error = _error(server.http().post("/v1/chat/completions", json=body), 400, "messages")
        assert words in error["message"], error


def test_a_1_mb_header_is_431_in_openais_shape(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head
    assert json.loads(body)["error"]["code"] == "headers_too_large"


def test_head_on_models_and_metrics(server):
    http = server.http()
    for path in ("/v1/models", "/metrics", "/health"):
        assert http.head(path).status_code == 200, path


def test_the_api_key_from_a_file_is_in_no_command_line(server):
    response = server.http(key=None).get("/v1/models")
    assert response.status_code == 401
    assert server.http().get("/v1/models").status_code == 200
    for pid in [server.process.pid, *_alive(server.children)]:
        assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


# ------------------------------------------------------------------------- fixes 2, 3: a rank that dies


def _ranks(srv: Server) -> list[int]:
    # forked from the server (StartedRanks), so they share its command line; not multiprocessing's resource tracker
    pids = [pid for pid in _children(srv.process.pid) if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(pids) == 2, pids
    return sorted(pids)


def test_an_idle_rank_killed_is_503_naming_the_rank_its_pid_and_signal(model_file):
    srv = Server(model_file, "--nproc", "2", "--api-key", KEY, "--served-model-name", NAME)
    try:
        assert srv.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200
        victim = _ranks(srv)[-1]  # rank 1: the later fork
        os.kill(victim, signal.SIGKILL)
        statuses = []  # /health until the server exits; once it has said 503, a completion too (no request runs before)
        while srv.process.poll() is None:
            try:
                statuses.append(srv.http(key=None).get("/health").status_code)
                if statuses[-1] == 503:
                    statuses.append(srv.http().post("/v1/completions", json={"model": NAME, "prompt": "hi"}).status_code)
            except httpx.TransportError:
                pass
        assert srv.process.wait(timeout=60) != 0
        first_bad = next((i for i, s in enumerate(statuses) if s == 503), len(statuses))
        assert set(statuses[:first_bad]) <= {200} and set(statuses[first_bad:]) <= {503}, statuses
        pattern = rf"rank 1 \(pid {victim}\) failed: the process exited with signal SIGKILL"
        assert any(re.search(pattern, line) for line in srv.lines), srv.lines[-8:]
        assert any(re.search(r"the engine failed \(.*" + pattern + r".*\): stopping the server", line) for line in srv.lines)
        time.sleep(0.5)
        assert _alive(srv.children) == []
    finally:
        srv.stop()


def test_a_rank_killed_under_a_step_is_a_503_and_the_ranks_restart(model_file):
    srv = Server(model_file, "--nproc", "2", "--api-key", KEY, "--served-model-name", NAME)
    try:
        victim = _ranks(srv)[-1]
        body = {"model": NAME, "prompt": "the cat", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with srv.http().stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the step loop runs
            os.kill(victim, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        errors = [json.loads(line[5:])["error"] for line in rest if '"error"' in line]
        assert errors and re.search(rf"rank 1 \(pid {victim}\) failed: the process exited with signal SIGKILL",
                                    errors[0]["message"])
        after = srv.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert after.status_code == 200, after.text  # new ranks serve
        assert srv.http(key=None).get("/health").status_code == 200
    finally:
        assert srv.stop() == 0


# ------------------------------------------------------------------------- vLLM's metric names


def test_vllm_metric_names_count_each_request(server):
    def scrape() -> dict[str, float]:
        values = {}
        for line in server.http().get("/metrics").text.splitlines():
            if line.startswith("vllm:"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    label = f'{{model_name="{NAME}"}}'
    before = scrape()
    response = server.client().completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert len(response.choices[0].token_ids) == 5
    after = scrape()
    for name, grew in (("vllm:e2e_request_latency_seconds_count", 1), ("vllm:request_queue_time_seconds_count", 1),
                       ("vllm:time_to_first_token_seconds_count", 1), ("vllm:inter_token_latency_seconds_count", 4),
                       ("vllm:time_per_output_token_seconds_count", 4), ("vllm:prompt_tokens_total", 3),
                       ("vllm:generation_tokens_total", 5)):
        assert after[name + label] - before.get(name + label, 0) == grew, name
    reason = f'vllm:request_success_total{{finished_reason="length",model_name="{NAME}"}}'
    assert after[reason] - before.get(reason, 0) == 1
    assert after["vllm:num_requests_running" + label] == 0 and after["vllm:num_requests_waiting" + label] == 0
    assert after["vllm:kv_cache_usage_perc" + label] == 0  # idle: only the prefix cache holds blocks
