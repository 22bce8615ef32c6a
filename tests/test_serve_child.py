"""treeattn.serve.child: the ready line `treeattn serve` prints is the one start_serve reads back,
and a child that ends before listening is one RuntimeError with its status and its error line.
(A child that listens is every server test's fixture, tests/helpers/serve.py.)"""

from __future__ import annotations

import pytest

from treeattn.serve.child import ready_line, ready_url, start_serve


def test_ready_line_round_trip():
    line = ready_line("/m/model.gguf", "127.0.0.1", 43567, 2, "tree")
    assert ready_url(line) == ("http://127.0.0.1:43567", 2)
    assert ready_url(line + "\n") == ("http://127.0.0.1:43567", 2)
    assert ready_url("INFO treeattn.serve: loading /m/model.gguf on 2 rank(s)") is None


def test_a_child_that_ends_before_listening_is_one_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"exited with status 2 before listening: .*MODEL: no such file or directory"):
        start_serve(tmp_path / "missing.gguf")


def test_the_ready_line_names_the_model_not_its_path():
    assert ready_line("/a/long/path/model.gguf", "127.0.0.1", 8000, 2, "tree").startswith("treeattn serve: model.gguf on http://")


def test_ctrl_c_prints_what_happens_and_that_the_server_stopped(tmp_path):
    """SIGINT (Ctrl-C): one line saying that requests in flight finish and the engine closes, then one that it stopped."""
    import signal
    import time

    import gguf

    pytest.importorskip("transformers")
    from gguf_files import write_gguf
    from helpers.gguf_models import hf_model

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model("llama"), gguf.GGMLQuantizationType.Q8_0, context_length=256)
    child = start_serve(path, "--block-size", "16")
    assert "tiny.gguf on http://" in child.lines[-1] and str(tmp_path) not in child.lines[-1]
    child.process.send_signal(signal.SIGINT)
    assert child.process.wait(timeout=120) == 0
    deadline = time.monotonic() + 10  # the reading thread may still be appending the last lines
    while time.monotonic() < deadline and not any("stopped" in line for line in child.lines):
        time.sleep(0.05)
    text = "".join(child.lines)
    assert "SIGINT: no new requests; the ones in flight finish" in text and "treeattn serve: stopped (cleanly)" in text, text
