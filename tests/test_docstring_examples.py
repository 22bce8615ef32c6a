"""The runnable examples in the public entry points' docstrings run and say what they show (doctest)."""

from __future__ import annotations

import doctest

import pytest

import treeattn.engine.client
import treeattn.engine.generate


@pytest.mark.parametrize("obj", [treeattn.engine.client.Engine, treeattn.engine.generate.generate, treeattn.engine.generate.stream],
                         ids=lambda o: o.__qualname__)
def test_docstring_example_runs(obj):
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(obj, globs={})
    assert tests and tests[0].examples, f"{obj.__qualname__} has no example"
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
