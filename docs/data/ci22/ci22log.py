"""Log (worker, start, end, nodeid) of every test's whole protocol (setup+call+teardown) to $CI22_LOG."""
import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    yield
    path = os.environ.get("CI22_LOG")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as f:
            f.write(f"{worker}\t{start:.3f}\t{time.time():.3f}\t{item.nodeid}\n")
