"""No import circle and no arrow back up in src/treeattn (issue 53): scripts/check_structure.py's checks, run in the tests.

The circle and arrow checks run here: function bodies over 80 lines are already policed by
tests/test_function_length.py, which reads the same bound with its own counter. Read with ast,
nothing of treeattn is imported, so the test takes well under a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_structure.py"


def _check_structure():
    spec = importlib.util.spec_from_file_location("check_structure", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_structure", module)
    spec.loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "treeattn" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_finds_a_circle_closed_by_a_lazy_import(tmp_path, monkeypatch):
    cs = _check_structure()
    root = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from treeattn.b import g\n",
        "b.py": "def g():\n    from . import a\n    return a\n",
        "c.py": "import treeattn.a\n",
    })
    monkeypatch.setattr(cs, "ROOT", root)  # module_name() reads paths against ROOT
    graph, _ = cs.import_graph(root)
    assert graph["treeattn.c"] == {"treeattn.a"}
    assert cs.circles(graph) == [["treeattn.a", "treeattn.b"]]


def test_no_import_circle_in_src():
    cs = _check_structure()
    graph, _ = cs.import_graph()
    assert len(graph) > 50
    cycles = cs.circles(graph)
    assert not cycles, "import circles (layers import downward: ops < parallel < cache < models < engine < " \
        "serve/eval/bench/sim): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_check_finds_an_arrow_back_up(tmp_path, monkeypatch):
    cs = _check_structure()
    root = _write(tmp_path, {
        "__init__.py": "",
        "ops/__init__.py": "", "ops/a.py": "from treeattn.models.m import x\n",  # ops may not import models
        "models/__init__.py": "", "models/m.py": "import treeattn\nfrom treeattn.ops import a\n",  # nor a room the root
        "bench/__init__.py": "", "bench/b.py": "from treeattn.eval import e\n",  # bench sits below eval
        "eval/__init__.py": "", "eval/e.py": "from treeattn.bench import b\n",
        "cli.py": "import treeattn\n",  # a top-level module may
    })
    monkeypatch.setattr(cs, "ROOT", root)
    graph, _ = cs.import_graph(root)
    assert cs.arrows_back_up(graph, root) == [("treeattn.bench.b", "treeattn.eval.e"), ("treeattn.models.m", "treeattn"),
                                              ("treeattn.ops.a", "treeattn.models.m")]


def test_no_arrow_back_up_in_src():
    """Imports point down ROOM_ORDER (DESIGN.md's layers): a piece two rooms share lives on the lower one's floor."""
    cs = _check_structure()
    graph, _ = cs.import_graph()
    back = cs.arrows_back_up(graph)
    assert not back, "imports that point up the layers: " + "; ".join(f"{a} -> {b}" for a, b in back)
