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
