"""A two-tier cluster on one machine: "nodes" are Linux network namespaces behind a shaped link.

    with two_tier_network(NetworkSpec(nodes=2, inter_mbit=200)) as net:
        records = run_decode_sweep(config, launcher=net.launcher())

Layout (needs root and iproute2; `tc` shaping with tbf, delay with netem when the kernel has it):

    namespace <prefix>sw:  bridge br0
    namespace <prefix>n<i> (one per node): eth0 = veth peer of port p<i> on br0, address
        10.<x>.<y>.<i+1>/24, lo up; tc on eth0 (node -> switch) and on p<i> (switch -> node):
        tbf rate R (and netem delay D/2 on each side when asked and available).

Ranks of one node run inside its namespace and talk to each other over that namespace's
loopback (fast, unshaped: the intra-node link); ranks on different nodes talk through the veth
pairs and the bridge, through the shaped links (the inter-node link). Every rank process gets
MASTER_ADDR = node 0's address (reachable from every namespace), GLOO_SOCKET_IFNAME=eth0,
LOCAL_WORLD_SIZE = ranks per node.

Cleanup always runs: the context manager deletes every namespace it made (which removes the veth
pairs and the bridge with them), also when the body raises or on SIGTERM/SIGINT; namespace names
carry the creating process id, so concurrent runs do not collide and nothing else is touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from treeattn.bench.config import SweepConfig
from treeattn.engine.measure import MALLOC_ENV

logger = logging.getLogger(__name__)


class NetnsUnavailable(RuntimeError):
    """This machine cannot build network namespaces (not root, no iproute2, or no permission)."""


@dataclass(frozen=True)
class NetworkSpec:
    """The emulated cluster network.

    Attributes:
        nodes: number of namespaces ("nodes"), >= 2.
        inter_mbit: bandwidth of each node's link to the switch, Mbit/s per direction (None:
            unshaped).
        inter_delay_ms: one-way delay between two nodes, ms (netem; 0 = none).
    """

    nodes: int
    inter_mbit: float | None = None
    inter_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 2:
            raise ValueError(f"nodes must be an int >= 2, got {self.nodes!r}")
        if self.nodes > 250:
            raise ValueError(f"nodes must be <= 250 (one /24 subnet), got {self.nodes}")
        if self.inter_mbit is not None and not (self.inter_mbit > 0):
            raise ValueError(f"inter_mbit (inter-node bandwidth) must be > 0 Mbit/s, got {self.inter_mbit}")
        if not (self.inter_delay_ms >= 0):
            raise ValueError(f"inter_delay_ms must be >= 0, got {self.inter_delay_ms}")


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def netns_unavailable_reason() -> str | None:
    """Why two-tier emulation cannot run here, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or under sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    probe = f"tap{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except RuntimeError as err:
        return f"cannot create a network namespace: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available(namespace: str, device: str) -> bool:
    """Whether the kernel has the netem qdisc (delay emulation)."""
    probe = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "handle", "9:", "netem", "delay", "1ms"],
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
        return True
    return False


@dataclass
class TwoTierNetwork:
    """A built network (see two_tier_network). Node i's namespace is `namespaces[i]`, its address
    `addresses[i]`."""

    spec: NetworkSpec
    prefix: str
    namespaces: list[str]
    addresses: list[str]
    switch: str
    delay_emulated: bool
    created: list[str] = field(default_factory=list)

    def tx_bytes(self) -> list[int]:
        """Bytes each node has sent out of its eth0 (i.e. to other nodes) so far."""
        out = []
        for ns in self.namespaces:
            text = _run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"])
            out.append(int(text.strip()))
        return out

    def launcher(self, ranks_per_node: int, python: str = sys.executable):
        """A run_decode_sweep launcher that runs each world size's ranks in these namespaces."""

        def launch(config: SweepConfig, world_size: int, records_path: str | None) -> list[dict]:
            return run_in_namespaces(self, config, world_size, ranks_per_node, records_path, python)

        return launch


def _shape(namespace: str, device: str, spec: NetworkSpec, delay_ok: bool) -> None:
    base = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
    parent = ["root"]
    if spec.inter_delay_ms > 0 and delay_ok:
        _run(base + ["root", "handle", "1:", "netem", "delay", f"{spec.inter_delay_ms / 2:.3f}ms"])
        parent = ["parent", "1:1"]
    if spec.inter_mbit is not None:
        rate_bytes = spec.inter_mbit * 1e6 / 8
        # bucket: >= rate / HZ (250) and a few MTUs; small, so that small messages are shaped too
        burst = max(8 * 1024, int(rate_bytes / 250))
        _run(base + parent + ["handle", "10:", "tbf", "rate", f"{spec.inter_mbit}mbit", "burst", str(burst), "latency", "200ms"])


@contextlib.contextmanager
def two_tier_network(spec: NetworkSpec) -> Iterator[TwoTierNetwork]:
    """Build the namespaces, bridge and shaped links; delete them all on exit (always).

    Raises:
        NetnsUnavailable: not root, no iproute2, or namespaces cannot be made; says which.
        ValueError: a delay was asked for but this kernel has no netem qdisc.
    """
    reason = netns_unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    pid = os.getpid()
    prefix = f"ta{pid}"
    subnet = f"10.{100 + pid % 100}.{(pid // 100) % 250}"
    net = TwoTierNetwork(
        spec=spec,
        prefix=prefix,
        namespaces=[f"{prefix}n{i}" for i in range(spec.nodes)],
        addresses=[f"{subnet}.{i + 1}" for i in range(spec.nodes)],
        switch=f"{prefix}sw",
        delay_emulated=False,
    )

    def cleanup() -> None:
        for ns in reversed(net.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        net.created.clear()

    def on_signal(signum, frame):  # noqa: ARG001
        cleanup()
        raise SystemExit(128 + signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, on_signal)
    try:
        _run(["ip", "netns", "add", net.switch])
        net.created.append(net.switch)
        _run(["ip", "-n", net.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", net.switch, "link", "set", "br0", "up"])
        _run(["ip", "-n", net.switch, "link", "set", "lo", "up"])
        for i, (ns, addr) in enumerate(zip(net.namespaces, net.addresses)):
            _run(["ip", "netns", "add", ns])
            net.created.append(ns)
            port = f"p{i}"
            _run(["ip", "-n", net.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", net.switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", net.switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if spec.inter_delay_ms > 0:
            net.delay_emulated = netem_available(net.namespaces[0], "eth0")
            if not net.delay_emulated:
                raise ValueError(
                    "inter_delay_ms > 0 needs the netem qdisc, which this kernel does not have "
                    "(tc: 'Specified qdisc kind is unknown'); rerun with delay 0 (bandwidth shaping uses tbf)"
                )
        for i, ns in enumerate(net.namespaces):
            _shape(ns, "eth0", spec, net.delay_emulated)
            _shape(net.switch, f"p{i}", spec, net.delay_emulated)
        logger.info("two-tier network %s: %d nodes %s", prefix, spec.nodes, net.addresses)
        yield net
    finally:
        cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_in_namespaces(
    net: TwoTierNetwork,
    config: SweepConfig,
    world_size: int,
    ranks_per_node: int,
    records_path: str | None,
    python: str = sys.executable,
) -> list[dict]:
    """Run one world size of a sweep with ranks_per_node ranks in each namespace.

    Rank r runs in namespace r // ranks_per_node as `python -m treeattn.bench.worker`. Returns
    rank 0's records. Raises RuntimeError naming the failed ranks (with their stderr); every rank
    process is ended on the way out.
    """
    if world_size % ranks_per_node:
        raise ValueError(f"world size {world_size} is not divisible by ranks_per_node {ranks_per_node}")
    nodes = world_size // ranks_per_node
    if nodes > len(net.namespaces):
        raise ValueError(f"world size {world_size} with {ranks_per_node} ranks per node needs {nodes} nodes, the network has "
                         f"{len(net.namespaces)}")
    port = 29500 + os.getpid() % 20000
    workdir = Path(tempfile.mkdtemp(prefix="treeattn-netns-"))
    result_path = workdir / "records.json"
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            env = {
                **os.environ,
                **MALLOC_ENV,
                "MASTER_ADDR": net.addresses[0],
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % ranks_per_node),
                "LOCAL_WORLD_SIZE": str(ranks_per_node),
                "GLOO_SOCKET_IFNAME": "eth0",
            }
            cmd = ["ip", "netns", "exec", net.namespaces[rank // ranks_per_node], python, "-m", "treeattn.bench.worker",
                   "--config", config.to_json(), "--result", str(result_path)]
            if records_path:
                cmd += ["--records", records_path]
            stderr = open(workdir / f"rank{rank}.err", "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr))
            stderr.close()
        # a healthy sweep gets `timeout` per case; once a rank fails, the rest get `timeout` more
        deadline = time.monotonic() + config.timeout * (1 + len(config.seq_lens) * len(config.methods))
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + config.timeout)
            time.sleep(0.2)
        errors = {}
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                errors[rank] = "still running at the deadline; killed"
            elif p.returncode != 0:
                errors[rank] = (workdir / f"rank{rank}.err").read_text()[-2000:]
        if errors:
            detail = "\n".join(f"--- rank {r}: {text}" for r, text in errors.items())
            raise RuntimeError(f"{len(errors)} of {world_size} ranks failed in the two-tier network:\n{detail}")
        return json.loads(result_path.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)
