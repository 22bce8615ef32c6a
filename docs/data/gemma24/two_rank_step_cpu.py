"""Two gloo ranks (ta.spawn, one torch thread each) run ta.generate on GEMMA's 4K synthetic prompt (packed, int8,
float16 KV) and time every decode step's RankRunner.step in each rank's thread CPU and wall clock.
PYTHONPATH=<src> python3 docs/data/gemma24/two_rank_step_cpu.py MODEL CONTEXT STEPS  -> one JSON line"""
import json, statistics, sys, time
import torch
import treeattn as ta


def run(rank, world, path, context, steps):
    torch.set_num_threads(1)
    from treeattn.engine.worker.runner import RankRunner
    from treeattn.models.synthetic import synthetic_prompt
    cpu, wall, compiled = [], [], []
    original = RankRunner.step

    def step(self, plan):
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        out = original(self, plan)
        if plan.chunks and all(ch.decoding for ch in plan.chunks):
            cpu.append((time.thread_time_ns() - c) / 1e6)
            wall.append((time.perf_counter_ns() - w) / 1e6)
            compiled.append(self.compiled_decode is not None)
        return out

    RankRunner.step = step
    model = ta.load_model(path, weight_format="packed", with_tokenizer=False)
    prompt = synthetic_prompt(context, model.config.vocab_size, 0)
    result = ta.generate(model, [prompt], max_new_tokens=steps + 1, ignore_eos=True, kv_cache_dtype="float16",
                         activation_format="int8")
    return {"rank": rank, "cpu_ms_median": statistics.median(cpu[2:]), "wall_ms_median": statistics.median(wall[2:]),
            "steps": len(cpu), "segments": all(compiled), "tokens": result.generated_ids[0][:8]}


if __name__ == "__main__":
    path, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps({"load": open("/proc/loadavg").read().split()[:3], "ranks": ta.spawn(run, 2, path, context, steps,
                                                                                          timeout=900)}))
