"""Warm-engine ms/token on one device: for each model, weight format and decode step, one Engine generates
the prompt twice (the first compiles and captures), the second is timed. Prints one JSON line per run."""
import json, sys, time
import torch
import treeattn as ta

device, ids_path, new, *models = sys.argv[1:]
ids, new = json.load(open(ids_path)), int(new)
steps = ("dynamic", "graph") if device == "cuda" else ("dynamic",)
for model in models:
    for fmt in ("packed", "dequantize"):
        for step in steps:
            row = dict(model=model.rsplit("/", 1)[-1], weight_format=fmt, decode_step=step, prompt=len(ids))
            try:
                t = time.perf_counter()
                with ta.Engine(model, device=device, decode_step=step, weight_format=fmt) as engine:
                    first = engine.generate(ids, max_new_tokens=new, ignore_eos=True)[0]
                    r = engine.generate(ids, max_new_tokens=new, ignore_eos=True)[0]
                row.update(ms_per_token=1e3 * r.decode_s / (len(r.token_ids) - 1), ttft_s=r.ttft_s,
                           first_ms_per_token=1e3 * first.decode_s / (len(first.token_ids) - 1), wall_s=time.perf_counter() - t,
                           same_as_first=r.token_ids == first.token_ids, token_ids=r.token_ids)
            except Exception as e:  # noqa: BLE001 -- the run's failure is the result
                row.update(error=f"{type(e).__name__}: {e}"[:400])
            print(json.dumps(row), flush=True)
