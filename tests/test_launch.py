"""torchrun past one machine: two launches of one node each (c10d rendezvous on 127.0.0.1) run
`treeattn generate` and `treeattn serve` (rank 0 serves HTTP) and give the tokens of `--nproc 2`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from treeattn.serve.child import ready_url

pytest.importorskip("transformers")

from helpers.llama_checkpoints import make_checkpoint  # noqa: E402

from treeattn.engine.generate import generate  # noqa: E402
from treeattn.models import load_model  # noqa: E402

PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
NEW = 6
DEADLINE_S = 300  # only against a hang: a run that passes takes seconds
pytestmark = pytest.mark.slow  # two torchrun nodes per test: scheduled first under pytest-xdist (tests/conftest.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("launch") / "llama"
    make_checkpoint("llama", directory)
    return directory


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch-ids") / "ids.json"
    path.write_text(json.dumps(PROMPT))
    return path


@pytest.fixture(scope="module")
def expected(checkpoint):
    """The greedy tokens of one process, which are those of `treeattn generate --nproc 2` (ta.spawn on
    this machine; test_cli_generate checks that they are equal), without spawning two more ranks here."""
    return generate(load_model(checkpoint), PROMPT, max_new_tokens=NEW).generated_ids[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(*command: str, per_node: int = 1) -> list[subprocess.Popen]:
    """Two torchrun launches of `per_node` ranks each, meeting at a c10d rendezvous on 127.0.0.1."""
    port = _free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node), "--rdzv-backend",
              "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}", "-m", "treeattn", *command]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return [subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
            for _ in range(2)]


def _end(nodes: list[subprocess.Popen]) -> None:
    """Kill what is left of the launches (each in its own session: the launcher and its worker)."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def test_generate_on_two_nodes(checkpoint, ids_file, expected):
    nodes = _two_nodes("generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", str(NEW), "--json")
    try:
        outs = [node.communicate(timeout=DEADLINE_S) for node in nodes]
    finally:
        _end(nodes)
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    reports = [json.loads(out) for out, _ in outs if out.strip()]
    assert len(reports) == 1  # rank 0 prints, the other rank nothing
    assert reports[0]["generated_ids"] == expected
    assert reports[0]["run"]["world_size"] == 2


def test_generate_on_two_nodes_in_the_helix_layout(checkpoint, ids_file, expected):
    """Two nodes of 2 ranks, --tp 2: each node's ranks split the heads, the MLP and the vocabulary
    (4 ways), the sequence is sharded across the nodes; the one-process tokens."""
    nodes = _two_nodes("generate", str(checkpoint), "--prompt-ids", str(ids_file), "--max-new-tokens", str(NEW), "--tp", "2",
                       "--json", per_node=2)
    try:
        outs = [node.communicate(timeout=DEADLINE_S) for node in nodes]
    finally:
        _end(nodes)
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    reports = [json.loads(out) for out, _ in outs if out.strip()]
    assert len(reports) == 1 and reports[0]["generated_ids"] == expected
    assert reports[0]["run"]["world_size"] == 4 and reports[0]["run"]["tp"] == 2


def test_serve_on_two_nodes(checkpoint, expected):
    nodes = _two_nodes("serve", str(checkpoint), "--port", "0")
    try:
        lines = [[], []]
        os.set_blocking(nodes[0].stderr.fileno(), False)
        os.set_blocking(nodes[1].stderr.fileno(), False)
        url, server, deadline = None, None, time.monotonic() + DEADLINE_S
        while url is None and time.monotonic() < deadline:
            for i, node in enumerate(nodes):
                line = node.stderr.readline()
                if line:
                    lines[i].append(line)
                    ready = ready_url(line)
                    if ready is not None:
                        url, server = ready[0], i
                        assert ready[1] == 2  # the world's ranks, not --nproc's default
                elif node.poll() is not None:
                    pytest.fail(f"a launch ended before serving ({node.returncode}): {''.join(lines[i])[-3000:]}")
            time.sleep(0.05)
        assert url is not None, "no launch served HTTP"
        response = httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": PROMPT, "max_tokens": NEW,
                                                             "temperature": 0}, timeout=DEADLINE_S)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected
        rank0 = _children(nodes[server].pid)
        assert len(rank0) == 1  # the launch's one worker
        os.kill(rank0[0], signal.SIGTERM)  # the server drains, closes the engine, every rank ends
        for node in nodes:
            node.wait(timeout=DEADLINE_S)
    finally:
        _end(nodes)
    assert [node.returncode for node in nodes] == [0, 0]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]
