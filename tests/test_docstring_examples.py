"""The runnable examples in the public entry points' docstrings run and show what they say (doctest).

Every name `treeattn.__all__` exports that a caller starts from (functions and the classes one builds)
has an example; the result types (GenerationResult, RequestResult, TokenEvent, TokenLogprob) are
returned, not built, and need none. The examples of the collectives (tree_decode, ring_decode,
ring_attention, comm_stats, sharded_bifurcated_attention) are rank code: they run on the two gloo
ranks of one ta.spawn, with group=None the world, so a stale example fails here.
"""

from __future__ import annotations

import doctest

import pytest

import treeattn as ta

RESULT_TYPES = {"GenerationResult", "RequestResult", "TokenEvent", "TokenLogprob"}
IN_RANKS = ("tree_decode", "ring_decode", "ring_attention", "comm_stats", "sharded_bifurcated_attention")
IN_PROCESS = tuple(sorted(set(ta.__all__) - RESULT_TYPES - set(IN_RANKS)))


def _run_examples(names) -> tuple[list[str], str]:
    """Run the docstring examples of ta.<name> for each name: (names without an example, the failures' report)."""
    import io

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


def _examples_rank(rank: int, world_size: int, names) -> tuple[list[str], str]:
    return _run_examples(names)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_docstring_example_runs(name):
    missing, failures = _run_examples([name])
    assert not missing, f"ta.{name} has no example"
    assert not failures, failures


def test_collectives_examples_run_on_two_ranks():
    for missing, failures in ta.spawn(_examples_rank, 2, IN_RANKS, timeout=120):
        assert not missing, f"no example in {missing}"
        assert not failures, failures


def test_a_stale_example_fails():
    """The runner reports a docstring whose shown output is not what the code gives."""

    def stale():
        """
        >>> 1 + 1
        3
        """

    ta.stale_example_probe = stale
    try:
        missing, failures = _run_examples(["stale_example_probe"])
    finally:
        del ta.stale_example_probe
    assert not missing and "Expected:\n    3\nGot:\n    2" in failures
