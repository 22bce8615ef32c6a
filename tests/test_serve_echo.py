"""The prompt's log-probabilities and the tokenizer routes of `treeattn serve`, over a real socket.

A tiny random Llama GGUF (tests/helpers/serve.py) served on 2 gloo ranks with two model names:
- /v1/completions with echo and logprobs (what lm-evaluation-harness's local-completions sends
  for loglikelihood requests) through the official openai client: the prompt's tokens and their
  logprobs (None for the first) equal ta.Engine's prompt_logprobs on one in-process rank (which
  equal transformers': tests/test_prompt_logprobs.py), then the new token's; the text is the prompt
  and the completion; vLLM's prompt_logprobs gives the same values in its shape;
- /tokenize, /detokenize, /tokenizer_info in vLLM's shapes, which lm-eval's probe accepts;
- --served-model-name given twice: /v1/models lists both, either is served, answers carry the first.
"""

from __future__ import annotations

import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

import treeattn as ta  # noqa: E402
from treeattn.models import load_tokenizer  # noqa: E402
from helpers.serve import KEY, NAME, Server, _alive  # noqa: E402

ALIAS = "tiny-alias"
PROMPT = "the cat sat on the mat and then the dog"


@pytest.fixture(scope="module")
def model_file(tiny_llama_gguf):
    return tiny_llama_gguf  # conftest's: one file for the server tests


@pytest.fixture(scope="module")
def server(model_file):
    srv = Server(model_file, "--nproc", "2", "--api-key", KEY, "--served-model-name", NAME, "--served-model-name", ALIAS)
    yield srv
    assert srv.stop() == 0
    time.sleep(0.5)
    assert _alive(srv.children) == []


@pytest.fixture(scope="module")
def reference(model_file):
    tokenizer = load_tokenizer(model_file)
    ids = tokenizer.encode(PROMPT).ids
    with ta.Engine(str(model_file), nproc=1, block_size=16, cache_tokens=4096) as engine:
        result, = engine.generate([ids], max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    return tokenizer, ids, result


def test_echo_with_logprobs_gives_the_prompts_logprobs(server, reference):
    tokenizer, ids, expected = reference
    answer = server.client().completions.create(model=ALIAS, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert answer.model == NAME
    choice = answer.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    want = [e.logprob for e in expected.prompt_logprobs[1:]] + [expected.logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert choice.text == PROMPT + tokenizer.decode(expected.token_ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_token_ids_and_vllms_prompt_logprobs(server, reference):
    _, ids, expected = reference
    body = {"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = server.http().post("/v1/completions", json=body).json()["choices"][0]
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token, entry, want in zip(ids[1:], prompt_logprobs[1:], expected.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] >= 1
        assert [e["rank"] for e in entry.values()][:2] == [1, 2]


def test_echo_refusals_name_the_field(server):
    body = {"model": NAME, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}
    response = server.http().post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    response = server.http().post("/v1/completions", json={"model": NAME, "prompt": "hi", "prompt_logprobs": 21})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


def test_tokenize_detokenize_and_tokenizer_info(server, reference):
    tokenizer, ids, _ = reference
    http = server.http()
    tokens = http.post("/tokenize", json={"model": ALIAS, "prompt": PROMPT, "return_token_strs": True}).json()
    assert tokens["tokens"] == ids and tokens["count"] == len(ids) and tokens["max_model_len"] > len(ids)
    assert tokens["token_strs"] == [tokenizer.id_to_token(t) for t in ids]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).json()["error"]["param"] == "tokens"
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.id_to_token(2) and info["chat_template"]
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1


def test_lm_evals_remote_tokenizer_probe_accepts_the_server(server):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(f"{server.url}/v1/completions", auth_token=KEY)
    remote = utils.RemoteTokenizer(f"{server.url}/v1/completions", auth_token=KEY)
    assert remote.decode(remote.encode(PROMPT)) == PROMPT


def test_models_lists_every_name_first_the_first(server):
    assert [m.id for m in server.client().models.list().data] == [NAME, ALIAS]
    assert server.client().completions.create(model=NAME, prompt="hi", max_tokens=1).model == NAME


def test_tokenizer_info_names_the_models_bos_without_a_chat_template(model_file):
    """A base model has no chat template; /tokenizer_info still names its BOS token (from the model's
    config), since lm-eval's remote tokenizer starts every rolling-perplexity window with it and
    falls back to EOS when it is missing (Gemma 3 270M's perplexity differed by that)."""
    from types import SimpleNamespace

    from treeattn.engine.worker.rank import model_info
    from treeattn.models import load_model
    from treeattn.serve.tokenize import tokenizer_info_body

    model = load_model(model_file)
    info = model_info(model)
    assert info.bos_token_id == 1
    engine = SimpleNamespace(tokenizer=load_tokenizer(model_file), model_info=info, max_context=512)
    body = tokenizer_info_body(SimpleNamespace(engine=engine, chat_template=None))
    assert body["bos_token"] == engine.tokenizer.id_to_token(1) and body["chat_template"] is None
    assert body["eos_token"] == engine.tokenizer.id_to_token(2)
