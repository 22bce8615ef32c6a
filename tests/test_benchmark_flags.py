"""The benchmark scripts name their flags as the `treeattn` commands do (read from their source, nothing runs).

--nproc for the number of ranks (never --world-size(s), --worlds, -p), --max-new-tokens (never
--new-tokens, --max-tokens), --threads for threads per rank, --repeats, --kv-cache-dtype, --context
for the prompt (or context) length in tokens (never --doc, --doc-tokens, --contexts), and
--output PATH for a JSON file of the results, as `treeattn bench` writes it (never --out, never a
visible --json: in the `treeattn` commands --json is the switch that prints one JSON object on stdout,
so a --json that takes a PATH would give one flag two meanings). Old spellings stay as hidden aliases:
argparse.SUPPRESS help, the same destination as the visible flag. The model is the optional
positional MODEL, as in `treeattn generate MODEL` (--model, or --gguf, is its hidden alias).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))
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
    assert len(SCRIPTS) > 20 and any(a["hidden"] for s in SCRIPTS for a in _arguments(s))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_visible_flags_use_the_cli_names(script):
    arguments = _arguments(script)
    visible = [a for a in arguments if not a["hidden"]]
    for argument in visible:
        retired = {n for n in argument["names"] if (script.name, n) not in OTHER_MEANING} & RETIRED
        assert not retired, f"{script.name}: {sorted(retired)} is an old spelling; use the CLI's name and keep it hidden"
        if "--output" in argument["names"]:
            assert "store_true" not in argument["keywords"].get("action", ""), f"{script.name}: --output takes a PATH"
        if "--json" in argument["names"]:  # the CLI's switch (one JSON object on stdout), never a file name
            assert argument["keywords"].get("action") == "'store_true'", \
                f"{script.name}: a visible --json takes no value; write a results file with --output PATH"
    dests = {a["dest"] for a in visible}
    hidden_dests = {a["dest"] for a in arguments if a["hidden"]}
    for positional in (a for a in visible if not a["names"][0].startswith("-") and a["dest"] in hidden_dests):
        # argparse stores an absent optional positional's default after the options: with any other
        # default, `--model X` would come out as that default. parse_args then starts from model=None.
        assert positional["keywords"].get("nargs") == "'?'", f"{script.name}: {positional['dest']} is an optional positional"
        assert positional["keywords"].get("default") == "argparse.SUPPRESS", \
            f"{script.name}: positional {positional['dest']} needs default=argparse.SUPPRESS, or its hidden alias is overwritten"
        assert "type" not in positional["keywords"], \
            f"{script.name}: positional {positional['dest']} takes no type= (argparse would convert the SUPPRESS string)"
        assert f"namespace=argparse.Namespace({positional['dest']}=" in script.read_text(), \
            f"{script.name}: parse_args must start from a namespace holding {positional['dest']}'s default"
    for alias in (a for a in arguments if a["hidden"]):
        assert alias["dest"] in dests, f"{script.name}: hidden {alias['names']} is no alias of a visible flag"
        assert alias["keywords"].get("default") == "argparse.SUPPRESS", f"{script.name}: {alias['names']} must not reset the default"
