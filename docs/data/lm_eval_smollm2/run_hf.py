import os, sys, json, time
os.environ["HF_DATASETS_OFFLINE"] = "1"
import torch, transformers
from treeattn.eval.demo import smollm2_path
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.models.huggingface import HFLM
path = smollm2_path()
t0 = time.time()
model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
print("loaded", time.time() - t0, flush=True)
os.chdir("/work/wt/eval48/tests/data/lm_eval")
tm = TaskManager(include_path="/work/wt/eval48/tests/data/lm_eval")
lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1)
print("prefix", lm.prefix_token_id, flush=True)
out = lm_eval.simple_evaluate(model=lm, tasks=["treeattn_mc", "treeattn_ppl", "treeattn_gen"], task_manager=tm, log_samples=True)
print("hf", time.time() - t0, json.dumps(out["results"], default=str)[:2000], flush=True)
json.dump({t: [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in v] for t, v in out["samples"].items()}, open("/tmp/eval48/hf.json", "w"), default=str)
