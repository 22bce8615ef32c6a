"""Every python block of README.md runs as a script (the placeholder model "./model" is the
installed SmolLM2 GGUF; the OpenAI client's server is conftest's session `treeattn serve`), and
what a block's comment says it prints is what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def _run(code: str, tmp_path: Path, name: str) -> str:
    script = tmp_path / f"readme_{name}.py"  # not the name of a module it imports
    script.write_text(code, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, f"README block {name} failed:\n{code}\n{out.stderr[-3000:]}"
    return out.stdout


def _block(start: str) -> str:
    found = [b for b in BLOCKS if start in b]
    assert len(found) == 1, f"README has {len(found)} python blocks with {start!r}"
    return found[0]


def test_every_block_is_covered():
    keys = ("ta.merge_states(*a, *b)", "ta.spawn(step, 4)", "gemma3_path()", "ta.Engine(", "from openai import OpenAI",
            "ta.spawn(prefill, 4)")
    assert len(BLOCKS) == len(keys) and all(sum(k in b for b in BLOCKS) == 1 for k in keys)


def test_merge_block(tmp_path):
    _run(_block("ta.merge_states(*a, *b)") + "\nassert torch.allclose(merged_out, out, atol=1e-5)\n"
         "assert torch.allclose(merged_lse, lse, atol=1e-4)\n", tmp_path, "merge")


def test_spawn_block_prints_what_it_says(tmp_path):
    block = _block("ta.spawn(step, 4)")
    claimed = re.search(r"# 4 gloo ranks here: (\[[^\]]*\])", block).group(1)
    assert _run(block, tmp_path, "spawn").strip() == claimed


def test_linear_attention_block_is_float32_rounding(tmp_path):
    errors = eval(_run(_block("ta.spawn(prefill, 4)"), tmp_path, "linear").strip())  # noqa: S307 -- our own printout
    assert len(errors) == 4 and max(errors) < 1e-5


@pytest.mark.slow  # scheduled first under pytest-xdist (tests/conftest.py): Gemma 3 270M loaded and run
def test_gemma3_block(tmp_path):
    from treeattn.eval.demo import gemma3_path

    if not Path(gemma3_path()).exists():
        pytest.skip("the Gemma 3 270M GGUF is not installed (scripts/install.sh installs it)")
    assert _run(_block("gemma3_path()"), tmp_path, "gemma3").strip()


@pytest.mark.slow  # scheduled first under pytest-xdist (tests/conftest.py): an engine on SmolLM2
def test_engine_block_on_smollm2(tmp_path):
    from treeattn.eval.demo import smollm2_path

    out = _run(_block("ta.Engine(").replace("\"./model\"", repr(str(smollm2_path()))), tmp_path, "engine")
    assert "'healthy': True" in out and "'running': 0" in out


@pytest.mark.slow  # scheduled first under pytest-xdist (tests/conftest.py): the session's SmolLM2 server
def test_openai_client_block_against_treeattn_serve(tmp_path, smollm2_server):
    """README's block against README's `treeattn serve ... --nproc 2 --served-model-name smollm2` (conftest's
    session server, shared with tests/test_lm_eval.py; it must exit 0 on SIGTERM at the session's end)."""
    block = _block("from openai import OpenAI").replace("http://127.0.0.1:8000", smollm2_server.url)
    assert _run(block, tmp_path, "openai").strip()
