"""One rank, one thread: MODEL (argv 2, a `treeattn models` name; default smollm2: packed, float16 KV, float32 activations: the exact path) decodes TOKENS greedy tokens
after the 4,084 ids of random_ids_4084.json; prints the process CPU ms of each decode step (time.process_time around
RankRunner.step: with torch.set_num_threads(1) the step's work is on this thread, so other processes' load does not
count as it does in wall time; memory contention still does). Run with PYTHONPATH=<tree>/src: e2e_f32_cpu_ab.sh."""
import json, os, sys, time
import torch
torch.set_num_threads(1)
import treeattn as ta
from treeattn.engine.worker import runner
ids = json.load(open(os.path.join(os.path.dirname(__file__), "random_ids_4084.json")))
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32
log = []
step = runner.RankRunner.step
def timed(self, plan):
    cpu, wall = time.process_time(), time.perf_counter()
    out = step(self, plan)
    if plan.chunks and all(c.decoding for c in plan.chunks):
        log.append((time.process_time() - cpu, time.perf_counter() - wall))
    return out
runner.RankRunner.step = timed
path = os.popen(f"treeattn models --path {sys.argv[2] if len(sys.argv) > 2 else 'smollm2'}").read().strip()
model = ta.load_model(path, weight_format="packed")
with ta.Engine(model, group=None, kv_cache_dtype="float16", activation_format="float32", timeout_s=600) as engine:
    r = engine.generate([ids], max_new_tokens=tokens, ignore_eos=True)[0]
cpu = sorted(c for c, _ in log[1:])
wall = sorted(w for _, w in log[1:])
print(json.dumps({"src": ta.__file__, "model": os.path.basename(path), "steps": len(log), "cpu_ms_median": round(1e3 * cpu[len(cpu) // 2], 2),
                  "cpu_ms_min": round(1e3 * cpu[0], 2), "wall_ms_median": round(1e3 * wall[len(wall) // 2], 2),
                  "threads": torch.get_num_threads(), "tokens": r.token_ids}))
