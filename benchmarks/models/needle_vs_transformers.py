"""Is treeattn's answer to a needle prompt the float32 model's own greedy answer? (transformers as the oracle)

    python benchmarks/models/needle_vs_transformers.py --context 8150 --max-new-tokens 12

Builds benchmarks/models/weight_format.py's needle prompt (treeattn.eval.haystack, depth 50 %, seed 0), runs
`treeattn generate` on it (one rank with the weights dequantized to float32, two ranks with them kept
packed), then one forward of transformers' model (the same GGUF dequantized to float32 by transformers,
SDPA) over the prompt and one rank's tokens: the argmax at every generated position, teacher-forced,
is greedy decoding by full recomputation (not transformers' cached generate()). Prints both token
lists, whether they are equal, and each position's top-1 minus top-2 logit (how close each choice was).
Needs transformers, gguf and accelerate.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from treeattn.bench import harness


def treeattn(model: str, ids_file: str, nproc: int, weight_format: str, new_tokens: int) -> list[int]:
    """The greedy tokens of `treeattn generate` on the prompt ids in ids_file."""
    return harness.generate_json(model, ids_file, nproc=nproc, weight_format=weight_format,
                                 max_new_tokens=new_tokens)["generated_ids"]


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", context=8150, max_new_tokens=12, threads=os.cpu_count(), output=False)
    args = harness.parse_args(parser)

    from transformers import AutoModelForCausalLM

    from treeattn.eval.haystack import is_correct, needle_case
    from treeattn.models.loader import read_model_files

    model = args.model
    files = read_model_files(model)
    case = needle_case(files.tokenizer, files.chat_template, context_tokens=args.context, depth=0.5, seed=0)
    print(f"# {os.path.basename(model)}: prompt {len(case.prompt_ids)} tokens, needle {case.answer} at {case.actual_depth:.0%}",
          flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(case.prompt_ids, f)
    ours = {(1, "dequantize"): treeattn(model, f.name, 1, "dequantize", args.max_new_tokens),
            (2, "packed"): treeattn(model, f.name, 2, "packed", args.max_new_tokens)}
    os.unlink(f.name)
    for (nproc, weight_format), tokens in ours.items():
        text = files.tokenizer.decode(tokens)
        print(json.dumps({"treeattn": f"{nproc} rank(s), weights {weight_format}", "tokens": tokens, "text": text,
                          "needle_retrieved": is_correct(text, case)}), flush=True)

    torch.set_num_threads(args.threads)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(model)), gguf_file=os.path.basename(model),
                                              dtype=torch.float32, attn_implementation="sdpa").eval()
    first = ours[(1, "dequantize")]
    start = time.perf_counter()
    with torch.inference_mode():
        logits = hf(torch.tensor([case.prompt_ids + first])).logits[0, len(case.prompt_ids) - 1 : -1].float()
    top = logits.topk(2, dim=-1)
    greedy = top.indices[:, 0].tolist()
    print(json.dumps({"transformers": "float32, one forward, teacher-forced argmax",
                      "forward_s": round(time.perf_counter() - start, 1),
                      "tokens": greedy, "text": files.tokenizer.decode(greedy),
                      "equal": {f"{p} rank(s), weights {w}": greedy == t for (p, w), t in ours.items()},
                      "top1_minus_top2": [round(a - b, 3) for a, b in top.values.tolist()]}))


if __name__ == "__main__":
    main()
