"""What a JSON-schema constraint costs per token at batch 1: SmolLM2 through ta.Engine, with and without it, alternated.

    PYTHONPATH=src python3 benchmarks/engine/structured_engine.py [--rounds 6] [--nproc 2] > docs/data/structured_engine.txt

One engine; each round runs the chat prompt twice, one request at a time: free (greedy, ignore_eos,
--tokens new tokens) and under benchmarks/retired/structured_mask.py's schema (greedy; it ends when the
document does). Time per token is RequestResult.decode_s / (tokens - 1) (the first token comes from
the prefill). The two kinds alternate round by round so that load from other processes hits both
alike; reported per round and as the ratio of the medians. The mask's cost is reported as the
driver's grammar work per token (masks() and advance(); on 2+ ranks masks() runs while the ranks run
the step), rank 0's wait for the masks at sampling per decode step (the part the step did not hide:
the "mask_wait" phase of its rank measurements) and apply_mask's time. The constrained output is printed and
checked against the schema
(structured_mask.py's, with each tag at most 12 characters: SmolLM2-135M looped in an unbounded one;
the schema is written out here, so that this script imports no other).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import treeattn as ta
from treeattn.bench import harness
from treeattn.models import load_tokenizer
from treeattn.models.chat import encode_chat, end_of_turn_id, read_chat_template

# structured_mask.py's schema with each tag bounded (a 135M model loops in an unbounded string: it ran to max_new_tokens)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
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
PROMPT = "Describe a fictional person as JSON with name, age, email, role, tags, address and score."


def _time_grammars(grammars) -> dict:
    """Wrap the driver's Grammars.masks and .advance with timers: {"s": seconds in them, "tokens": advances}.
    masks() runs while the ranks run the step (on 2+ ranks): this is the driver's work, not what waits."""
    box = {"s": 0.0, "tokens": 0}
    masks, advance = grammars.masks, grammars.advance

    def timed_masks(plan):
        started = time.perf_counter()
        try:
            return masks(plan)
        finally:
            box["s"] += time.perf_counter() - started

    def timed_advance(seq_id, token):
        started = time.perf_counter()
        try:
            return advance(seq_id, token)
        finally:
            box["s"] += time.perf_counter() - started
            box["tokens"] += seq_id in grammars._matchers

    grammars.masks, grammars.advance = timed_masks, timed_advance
    return box


def _mask_wait_s(engine) -> tuple[float, int]:
    """(seconds rank 0 waited for the masks at sampling, decode steps) since the last reset: the mask's exposed part."""
    steps = engine.rank_measurements(reset=True)[0].step_phases.get("decode", [])
    return sum(phases.get("mask_wait", 0.0) for phases in steps), len(steps)


def _apply_mask_us(engine) -> float:
    from treeattn.engine.structured import apply_mask

    vocab = engine.model_info.vocab_size
    logits, mask = torch.randn(1, vocab), bytes([0x55]) * ((vocab + 31) // 32 * 4)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        apply_mask(logits, mask)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", nproc=1, output=False)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    args = harness.parse_args(parser)
    path = args.model
    tokenizer, template = load_tokenizer(path), read_chat_template(path)
    prompt = encode_chat(tokenizer, template, [{"role": "user", "content": PROMPT}])
    stop = [end_of_turn_id(tokenizer, template)]
    print(f"loadavg: {open('/proc/loadavg').read().strip()}  torch threads: {torch.get_num_threads()}  nproc: {args.nproc}")
    free_params = ta.SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    constrained = ta.SamplingParams(max_new_tokens=256, stop_token_ids=stop, structured=ta.StructuredOutput.json(SCHEMA))
    per_token, wait = {"free": [], "json_schema": []}, {"s": 0.0, "steps": 0}
    with ta.Engine(path, nproc=args.nproc, max_batch_size=1) as engine:
        engine.generate([prompt], constrained)  # warm: the grammar's tokenizer is built on the first constrained request
        driver_s = _time_grammars(engine._driver.grammars)
        for round_ in range(args.rounds):
            for name, params in (("free", free_params), ("json_schema", constrained))[:: 1 if round_ % 2 == 0 else -1]:
                engine.rank_measurements(reset=True)
                result = engine.generate([prompt], params)[0]
                if name == "json_schema":
                    waited, steps = _mask_wait_s(engine)
                    wait["s"], wait["steps"] = wait["s"] + waited, wait["steps"] + steps
                per_token[name].append(result.decode_s / (len(result.token_ids) - 1))
                print(f"round {round_} {name}: {len(result.token_ids)} tokens, {result.finish_reason}, "
                      f"{per_token[name][-1] * 1e3:.2f} ms/token")
        text = engine.generate([prompt], constrained)[0].text
    print("constrained output:", text)
    print(f"the driver's grammar work (masks filled, tokens consumed) over the constrained requests: "
          f"{driver_s['s'] * 1e3:.1f} ms for {driver_s['tokens']} tokens = {driver_s['s'] / driver_s['tokens'] * 1e6:.0f} "
          f"us/token")
    apply_us = _apply_mask_us(engine)
    print(f"rank 0's apply_mask on (1, {engine.model_info.vocab_size}) logits: {apply_us:.0f} us (median of 200)")
    wait_us = wait["s"] / max(wait["steps"], 1) * 1e6
    print(f"rank 0's wait for the masks at sampling (the driver's work not hidden by the step): {wait['s'] * 1e3:.1f} ms "
          f"over {wait['steps']} decode steps = {wait_us:.0f} us/token")
    import jsonschema

    jsonschema.validate(json.loads(text), SCHEMA)
    print("the constrained output validates against the schema")
    for name, values in per_token.items():
        print(f"{name}: median {statistics.median(values) * 1e3:.2f} ms/token over {len(values)} rounds")
    ratio = statistics.median(per_token["json_schema"]) / statistics.median(per_token["free"])
    print(f"json_schema / free, medians: {ratio:.3f}")
    exposed = (wait_us + apply_us) / 1e6 / statistics.median(per_token["json_schema"])
    print(f"the mask's exposed cost (rank 0's wait + apply_mask) / constrained time per token: {exposed * 100:.2f} %")
    print(f"loadavg: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
