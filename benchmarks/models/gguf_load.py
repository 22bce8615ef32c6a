"""Load time and peak resident memory: a GGUF file vs the Hugging Face directory of the same model;
with --serve also the time until `treeattn serve` answers /health, in the same run.

    flock /tmp/treeattn-quiet.lock python benchmarks/models/gguf_load.py [MODEL] [--dir DIR] [--repeats 3] [--serve 1 2]

The HF directory is written once from the GGUF's dequantized weights (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template), so both hold the same float32 model.
Each load runs in a fresh process: after importing torch and treeattn, the process's RSS is the
baseline; `ta.load_model(path)` is timed, and the peak RSS (VmHWM) minus the baseline is what the
load added. The float32 weights themselves are the floor for both. Prints one JSON line per load
and a summary (medians).

The GGUF file is loaded three ways: with TREEATTN_GGUF_CACHE=0 (read and dequantized from the file),
from its converted copy (treeattn.models.gguf_cache, in a temporary TREEATTN_CACHE_DIR that is
removed at the end; the one load that converts and writes the copy is timed once, before the
repeats), and kept packed as the file ships it (weight_format="packed": Q4_0/Q4_1/Q8_0 tensors stay
quantized, the rest float32; what the engine loads on a CPU by default), from the file and from its
own converted copy (written by one load before the repeats, like the dequantized one).

--serve N...: for each rank count N, `python -m treeattn serve GGUF --nproc N --port 0` is started
and timed from the Popen to the first 200 from GET /health (interpreter start, imports, the ranks
starting and loading the model, the engine's set-up, uvicorn binding), then stopped with SIGTERM;
the repeats alternate with the loads above, so all see the same machine load.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from treeattn.bench import harness

CHILD = r"""
import json, sys, time
import torch, treeattn as ta
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
start = time.perf_counter()
model = ta.load_model(sys.argv[1], weight_format=sys.argv[2])
seconds = time.perf_counter() - start
from treeattn.models.packed import weight_bytes
weights = weight_bytes(model)
print(json.dumps({"path": sys.argv[1], "load_s": seconds, "peak_added_bytes": status("VmHWM:") - base, "weights_bytes": weights,
                  "tokenizer": model.tokenizer is not None, "chat_template": model.chat_template is not None}))
"""


PACKED = "gguf, kept packed (weight_format='packed', the engine's default on a CPU)"
PACKED_COPY = "gguf, kept packed, from its converted copy"


def write_hf_dir(gguf_path: Path, directory: Path) -> None:
    """An HF directory holding the GGUF model's dequantized float32 weights, tokenizer and template."""
    from safetensors.torch import save_file

    import treeattn as ta

    model = ta.load_model(gguf_path)
    c = model.config
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [c.architecture], "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings,
              "max_position_embeddings": c.max_position_embeddings,
              "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "hidden_act": "silu"}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    model.tokenizer.save(str(directory / "tokenizer.json"))
    template = model.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template.template,
                                                                 "bos_token": template.bos_token,
                                                                 "eos_token": template.eos_token}))


def serve_ready_s(path: str, nproc: int) -> float:
    """Seconds from starting `treeattn serve path --nproc nproc` to its first 200 on /health."""
    import signal
    import time
    import urllib.request

    from treeattn.serve.child import start_serve

    start = time.perf_counter()
    child = start_serve(path, "--nproc", str(nproc), "--log-level", "warning")
    server = child.process
    try:
        while True:
            try:
                with urllib.request.urlopen(child.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.01)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def main() -> None:
    parser = harness.parser(__doc__, model="smollm2", repeats=3, output=False,
                            helps={"model": "a .gguf file"})
    parser.add_argument("--dir", type=Path, default=Path("/tmp/treeattn-smollm2-hf"))
    parser.add_argument("--serve", type=int, nargs="*", default=[], help="rank counts of treeattn serve to time to /health")
    args = harness.parse_args(parser)
    args.model = Path(args.model)
    if not (args.dir / "model.safetensors").exists():
        write_hf_dir(args.model, args.dir)
    import os
    import shutil
    import tempfile

    cache = tempfile.mkdtemp(prefix="treeattn-gguf-load-")
    environments = {"gguf, from the file": {"TREEATTN_GGUF_CACHE": "0"},
                    "gguf, from its converted copy": {"TREEATTN_GGUF_CACHE": "1", "TREEATTN_CACHE_DIR": cache},
                    PACKED: {"TREEATTN_GGUF_CACHE": "0"},
                    PACKED_COPY: {"TREEATTN_GGUF_CACHE": "1", "TREEATTN_CACHE_DIR": cache},
                    "safetensors": {}}
    sources = {"gguf, from the file": str(args.model), "gguf, from its converted copy": str(args.model), PACKED: str(args.model),
               PACKED_COPY: str(args.model), "safetensors": str(args.dir)}

    def load(label: str) -> dict:
        weight_format = "packed" if label in (PACKED, PACKED_COPY) else "dequantize"
        out = subprocess.run([sys.executable, "-c", CHILD, sources[label], weight_format], capture_output=True, text=True,
                             check=True,
                             env={**os.environ, **environments[label]})
        row = {"what": label, **json.loads(out.stdout.strip().splitlines()[-1])}
        print(json.dumps(row), flush=True)
        return row

    try:
        convert = load("gguf, from its converted copy")  # the first load converts and writes the copy
        convert_packed = load(PACKED_COPY)
        rows: dict[str, list[dict]] = {label: [] for label in environments}
        serve_rows: dict[int, list[float]] = {}
        for _ in range(args.repeats):
            for label in rows:  # alternate, so all see the same machine load
                rows[label].append(load(label))
            for nproc in args.serve:
                ready = serve_ready_s(str(args.model), nproc)
                print(json.dumps({"serve": str(args.model), "nproc": nproc, "ready_s": ready}), flush=True)
                serve_rows.setdefault(nproc, []).append(ready)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"gguf, first load with the cache on (converts and writes the copy): {convert['load_s']:.2f} s; "
          f"packed: {convert_packed['load_s']:.2f} s")
    loads = {}
    for label, runs in rows.items():
        loads[label] = statistics.median(r["load_s"] for r in runs)
        print(f"{label}: load {loads[label]:.2f} s (median of {len(runs)}), "
              f"peak RSS added {statistics.median(r['peak_added_bytes'] for r in runs) / 2**20:.0f} MiB, "
              f"weights {runs[0]['weights_bytes'] / 2**20:.0f} MiB")
    hf_s = loads["safetensors"]
    for label in ("gguf, from the file", "gguf, from its converted copy", PACKED, PACKED_COPY):
        print(f"{label} / safetensors load time: {loads[label] / hf_s:.2f}x (goal <= 1.5x)")
    gguf_s = loads["gguf, from the file"]
    for nproc, runs in serve_rows.items():
        ready = statistics.median(runs)
        print(f"treeattn serve --nproc {nproc}: /health after {ready:.2f} s (median of {len(runs)}); "
              f"one process's GGUF load from the file + 2 s = {gguf_s + 2:.2f} s; ratio {ready / (gguf_s + 2):.2f}x (goal <= "
              f"1.5x)")


if __name__ == "__main__":
    main()
