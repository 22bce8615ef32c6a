"""Run the docstring examples of treeattn's public names (doctest), for tests/test_docstring_examples.py
and, for the collectives (rank code), inside the 2-rank spawn of tests/test_parallel_decode.py.

    missing, failures = run_examples(["attention"])   # (names without an example, the failures' report)
"""

from __future__ import annotations

import doctest
import io

import treeattn as ta

# The examples of the collectives are rank code (group=None, the world): they run on 2 gloo ranks.
IN_RANKS = ("tree_decode", "ring_decode", "ring_attention", "comm_stats", "sharded_bifurcated_attention")


def run_examples(names) -> tuple[list[str], str]:
    """Run the docstring examples of ta.<name> for each name: (names without an example, the failures' report)."""
    finder, out = doctest.DocTestFinder(recurse=False), io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    missing = []
    for name in names:
        tests = finder.find(getattr(ta, name), name, globs={})
        if not any(test.examples for test in tests):
            missing.append(name)
        for test in tests:
            runner.run(test, out=out.write)
    return missing, out.getvalue()
