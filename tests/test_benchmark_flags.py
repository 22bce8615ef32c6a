"""The benchmark scripts name their flags as the `treeattn` commands do (read from their source, nothing runs).

--nproc for the number of ranks (never --world-size(s), --worlds, -p), --max-new-tokens (never
--new-tokens, --max-tokens), --threads for threads per rank, --repeats, --kv-cache-dtype, --context
for the prompt (or context) length in tokens (never --doc, --doc-tokens, --contexts), and
--output PATH for a file of the results (never --out, never a visible --json that takes a value: in the
`treeattn` commands --json is the switch that prints one JSON object on stdout). The model is the
optional positional MODEL, as in `treeattn generate MODEL`. The old spellings are gone, hidden aliases
too (issue 53): no flag is hidden. The common flags come from treeattn.bench.harness, and no script
imports another script (a sibling import breaks as soon as the scripts live in different folders).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.rglob("*.py"))
RETIRED = {"--world-size", "--world-sizes", "--worlds", "-p", "--gpus", "--new-tokens", "--max-tokens", "--out",
           "--threads-per-rank", "--repeat", "--kv", "--capacity", "--model",
           "--doc", "--doc-tokens", "--contexts", "--gguf"}
# (script, flag): where the retired name means something else than the CLI's concept
OTHER_MEANING = {("make_draft_gguf.py", "--out"),  # the .gguf file it writes, not results as JSON
                 ("make_llama_gguf.py", "--out"),  # idem
                 ("gpu_engine.py", "--gguf")}  # the file of one of several --models, not the model argument


def _arguments(path: Path) -> list[dict]:
    """Every parser.add_argument(...) of a script: its option strings, keywords (as source) and dest."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            longest = max(names, key=len)
            dest = keywords.get("dest", repr(longest.lstrip("-").replace("-", "_"))).strip("'\"")
            found.append({"names": names, "keywords": keywords, "dest": dest,
                          "hidden": keywords.get("help") == "argparse.SUPPRESS"})
    return found


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 20 and any(a["names"] == ["--output"] for s in SCRIPTS for a in _arguments(s))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_visible_flags_use_the_cli_names(script):
    arguments = _arguments(script)
    visible = [a for a in arguments if not a["hidden"]]
    for argument in visible:
        retired = {n for n in argument["names"] if (script.name, n) not in OTHER_MEANING} & RETIRED
        assert not retired, f"{script.name}: {sorted(retired)} is an old spelling; use the CLI's name"
        if "--output" in argument["names"]:
            assert "store_true" not in argument["keywords"].get("action", ""), f"{script.name}: --output takes a PATH"
        if "--json" in argument["names"]:  # the CLI's switch (one JSON object on stdout), never a file name
            assert argument["keywords"].get("action") == "'store_true'", \
                f"{script.name}: a visible --json takes no value; write a results file with --output PATH"
    hidden = [a["names"] for a in arguments if a["hidden"]]
    assert not hidden, f"{script.name}: {hidden} are hidden flags; retired spellings are dropped, not kept as aliases"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_script_imports_another(script):
    siblings = {p.stem for p in SCRIPTS}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        shared = {n.split(".")[0] for n in names} & siblings
        assert not shared, f"{script.name} imports the script(s) {sorted(shared)}: move what they share to treeattn.bench.harness"
