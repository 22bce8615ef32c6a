import os, sys, json, time
sys.path.insert(0, "/work/wt/eval48/tests")
os.environ["HF_DATASETS_OFFLINE"] = "1"
from treeattn.eval.demo import smollm2_path
from treeattn.serve.child import start_serve
import lm_eval
from lm_eval.tasks import TaskManager
path = smollm2_path()
os.chdir("/work/wt/eval48/tests/data/lm_eval")
tm = TaskManager(include_path="/work/wt/eval48/tests/data/lm_eval")
t0 = time.time()
child = start_serve(path, "--nproc", "2", "--served-model-name", "smollm2", "--max-context", "2048", env=dict(os.environ, OMP_NUM_THREADS="1"))
print("server up", time.time() - t0, child.url, flush=True)
try:
    out = lm_eval.simple_evaluate(model="local-completions", model_args={"base_url": f"{child.url}/v1/completions", "model": "smollm2"},
                                  tasks=["treeattn_mc", "treeattn_ppl", "treeattn_gen"], task_manager=tm, log_samples=True)
    print("served", time.time() - t0, json.dumps(out["results"], default=str)[:2000], flush=True)
    json.dump({t: [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in v] for t, v in out["samples"].items()}, open("/tmp/eval48/served.json", "w"), default=str)
finally:
    child.process.terminate(); child.process.wait(60)
