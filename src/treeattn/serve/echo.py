"""The prompt in a /v1/completions answer: OpenAI's legacy `echo` and vLLM's `prompt_logprobs`.

    {"prompt": "The cat", "max_tokens": 1, "echo": true, "logprobs": 1}
      -> choice["text"] = "The cat" + the completion; choice["logprobs"] = {"tokens": [prompt tokens..., new tokens...],
         "token_logprobs": [None, lp, ..., lp], "top_logprobs": [None, {tok: lp}, ...], "text_offset": [0, ...]}
    {"prompt": "The cat", "prompt_logprobs": 2}
      -> choice["prompt_logprobs"] = [None, {"<id>": {"logprob": lp, "rank": r, "decoded_token": "..."}, ...}, ...]

The values come from the engine (SamplingParams.prompt_logprobs, computed in the prefill:
treeattn.engine.worker.prompt_logprobs); a request asking for them does not start from the prefix cache.
This is what lm-evaluation-harness's `local-completions` model sends for its loglikelihood
requests (echo, logprobs 1, max_tokens 1, temperature 0).
"""

from __future__ import annotations

import itertools

from treeattn.engine.request import TokenLogprob


def prompt_logprobs_asked(body) -> int | None:
    """The k of SamplingParams.prompt_logprobs a /v1/completions body asks for: vLLM's prompt_logprobs,
    else with echo its logprobs (None: none)."""
    if getattr(body, "prompt_logprobs", None) is not None:
        return body.prompt_logprobs
    return body.logprobs if getattr(body, "echo", False) else None


def echo_text(tokenizer, prompt) -> str:
    """The prompt's text for an echo: the string as sent, or the decoded token ids."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(list(prompt), skip_special_tokens=False) if tokenizer is not None else ""


def echo_logprobs(token_text, prompt: list[int], prompt_entries: list[TokenLogprob | None], ids: list[int],
                  entries: list[TokenLogprob]) -> dict:
    """OpenAI's legacy completions logprobs over the prompt then the new tokens.

    Args:
        token_text: token id -> its text.
        prompt, prompt_entries: the prompt's ids and RequestResult.prompt_logprobs (None first).
        ids, entries: the generated ids and their TokenLogprobs.

    Returns:
        {"tokens", "token_logprobs" (None for the first prompt token), "top_logprobs" (None for it),
        "text_offset" (each token's offset in the echoed text: the sum of the token strings before it)}.
    """
    all_ids = list(prompt) + list(ids)[: len(entries)]
    all_entries = list(prompt_entries) + list(entries)
    tokens = [token_text(t) for t in all_ids]
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in all_entries],
            "top_logprobs": [None if e is None else {token_text(a): lp for a, lp in e.top} for e in all_entries],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []}


def vllm_prompt_logprobs(token_text, prompt: list[int], prompt_entries: list[TokenLogprob | None]) -> list:
    """vLLM's choice["prompt_logprobs"]: None for the first token, then per token a dict of token id
    (a string in JSON) -> {"logprob", "rank", "decoded_token"}: the prompt token itself and the top k."""
    out = []
    for token, entry in zip(prompt, prompt_entries):
        if entry is None:
            out.append(None)
            continue
        ranked = {str(a): {"logprob": lp, "rank": r, "decoded_token": token_text(a)} for r, (a, lp) in enumerate(entry.top, 1)}
        ranked.setdefault(str(token), {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": token_text(token)})
        out.append(ranked)
    return out
