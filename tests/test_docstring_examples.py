"""The runnable examples in the public entry points' docstrings run and show what they say (doctest).

Every name `treeattn.__all__` exports that a caller starts from (functions and the classes one builds)
has an example; the result types (GenerationResult, RequestResult, TokenEvent, TokenLogprob) are
returned, not built, and need none. The examples of the collectives (tree_decode, ring_decode,
ring_attention, comm_stats, sharded_bifurcated_attention) are rank code: they run on the two gloo
ranks of tests/test_parallel_decode.py's p = 2 spawn (one spawn fewer in CI), with group=None the
world, so a stale example fails there (test_collectives_docstring_examples_run_on_two_ranks).
"""

from __future__ import annotations

import pytest
from helpers.doc_examples import IN_RANKS, run_examples

import treeattn as ta

RESULT_TYPES = {"GenerationResult", "RequestResult", "TokenEvent", "TokenLogprob"}
IN_PROCESS = tuple(sorted(set(ta.__all__) - RESULT_TYPES - set(IN_RANKS)))


@pytest.mark.parametrize("name", IN_PROCESS)
def test_docstring_example_runs(name):
    missing, failures = run_examples([name])
    assert not missing, f"ta.{name} has no example"
    assert not failures, failures


def test_every_public_name_has_its_examples_run():
    """Each exported name is run here, run on ranks, or a result type: none is left out."""
    assert set(ta.__all__) == set(IN_PROCESS) | set(IN_RANKS) | RESULT_TYPES
    assert set(IN_RANKS) <= set(ta.__all__) and RESULT_TYPES <= set(ta.__all__)


def test_a_stale_example_fails():
    """The runner reports a docstring whose shown output is not what the code gives."""

    def stale():
        """
        >>> 1 + 1
        3
        """

    ta.stale_example_probe = stale
    try:
        missing, failures = run_examples(["stale_example_probe"])
    finally:
        del ta.stale_example_probe
    assert not missing and "Expected:\n    3\nGot:\n    2" in failures
