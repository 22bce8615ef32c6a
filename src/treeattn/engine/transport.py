"""How the driver reaches the ranks: two transports with one interface (run a plan, alive, close).

    channel = SpawnedRanks(model, config, ranks)  # nproc rank processes run by ta.spawn (ranks: started earlier, or None); a
    socket to rank 0
    channel = GroupChannel(model, config, group)  # inside an existing group (or one rank): rank 0 runs its share itself
    outcome = channel.run(plan)                   # rank 0's StepOutcome (or a Measure's measurements)
    channel.close()                               # the ranks leave serve_steps and end

SpawnedRanks starts the rank processes (rank.rank_main) in the caller's thread (treeattn.parallel.spawn.start:
the fork server's ranks on Linux), supervises them from a background thread and waits for rank 0 to connect
back with its ModelInfo; a plan goes to rank 0 over that connection and rank 0
broadcasts it. The plan crosses both hops in one encoding (plan_message.encode, made here once): rank 0
decodes the words it receives and broadcasts their ranks' part as they came. A plan that raised on rank 0 comes back as
StepFailed, and restart() replaces the
ranks with new ones (the driver then recomputes its sequences); ranks that are gone (killed, or
rank 0's connection lost) come back as EngineError, which fails the engine. GroupChannel broadcasts the plan itself;
its ranks are the caller's, so it cannot restart them (restartable False).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from multiprocessing.connection import Listener

import torch
import torch.distributed as dist

from treeattn.engine.config import EngineConfig
from treeattn.engine.device import backend_for, rank_device
from treeattn.engine.plan_message import PlanWire, encode, plan_device
from treeattn.engine.worker.rank import (ModelInfo, helix_layout, load_model, make_runner, model_info, no_delay, rank_main,
                                         run_plan, serve_steps)
from treeattn.engine.errors import EngineError, StepFailed
from treeattn.engine.worker.runner import StepOutcome
from treeattn.ops.openmp import release_thread_pool

logger = logging.getLogger(__name__)


def overlap_masks(config: EngineConfig) -> bool:
    """Whether the driver fills a step's structured-output masks while the ranks run the step (vLLM v1's
    overlap) rather than before the plan leaves: on CUDA ranks, and on the CPU only where a core is left
    beyond the ranks' threads. Where the ranks' threads take every core (the CPU default: cores // nproc
    each), the driver's work competes with the ranks for them: measured quiet (SmolLM2, 2 ranks on 2 cores,
    benchmarks/engine/structured_engine.py, docs/serve.md), a constrained token took 1.080x a free one with
    the overlap and 1.012x with the masks filled first.

        >>> overlap_masks(EngineConfig(nproc=2, threads_per_rank=1)) == (len(os.sched_getaffinity(0)) > 2)
        True
    """
    if backend_for(config.device) == "nccl":
        return True
    from treeattn.parallel.spawn import rank_threads

    threads = config.threads_per_rank or rank_threads(config.nproc)
    return len(os.sched_getaffinity(0)) > config.nproc * threads


class SpawnedRanks:
    """The rank processes of an Engine started with ta.spawn, and the driver's line to rank 0."""

    restartable = True

    def __init__(self, model, config: EngineConfig, ranks=None) -> None:
        self.config, self._model = config, model
        self._start(ranks)

    def _start(self, ranks=None) -> None:
        """Run rank_main on `ranks` (a StartedRanks for the first start, adopted by spawn) or on new
        processes, started here, in the caller's thread (where ta.spawn judges the start method), and
        supervised by a thread of their own."""
        from treeattn.parallel.spawn import spawn, start

        config = self.config
        self._authkey = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self.failure: BaseException | None = None
        self.death: str | None = None  # the first rank the supervisor saw fail: "rank 1 (pid 4242): ... signal SIGKILL ..."
        args = (rank_main, config.nproc, self._listener.address, self._authkey, self._model, config)
        options = dict(backend=backend_for(config.device), timeout=config.timeout_s, threads=config.threads_per_rank,
                       on_failure=self._on_failure)
        if ranks is None:
            try:
                group = start(*args, **options)
            except Exception as exc:
                self._listener.close()
                raise EngineError(f"the engine's ranks failed to start: {exc}") from exc
            supervise, self._processes = group.join, group.ranks
        else:
            supervise = functools.partial(spawn, *args, ranks=ranks, **options)  # hands the work to the started ranks
            self._processes = ranks
        self._thread = threading.Thread(target=self._supervise, args=(supervise,), name="treeattn-engine-ranks", daemon=True)
        self._thread.start()
        logger.debug("%s %d rank process(es)", "starting" if ranks is None else "handing the work to the started", config.nproc)
        accepted: list = []
        acceptor = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        acceptor.start()
        deadline = time.monotonic() + max(config.timeout_s, 120.0)
        while not accepted:
            if not self._thread.is_alive():
                self._listener.close()
                raise EngineError(f"the engine's ranks failed to start: {self.failure}")
            if time.monotonic() > deadline:
                self._listener.close()
                raise EngineError("the engine's ranks did not start in time")
            acceptor.join(0.05)
        self._conn = accepted[0]
        no_delay(self._conn)
        kind, info = self._recv()
        self.info: ModelInfo = info
        logger.debug("rank 0 is ready")

    def restart(self) -> None:
        """End these ranks (a step failed on them) and start new ones with empty caches."""
        self.close()
        self._start()

    def _supervise(self, supervise) -> None:
        """Run `supervise` (the ranks' supervision, until they end) and keep what ended it."""
        try:
            supervise()
        except BaseException as exc:  # noqa: BLE001
            self.failure = exc

    def _on_failure(self, rank: int, pid: int | None, text: str) -> None:
        """The supervisor saw its first failed rank (treeattn.parallel.spawn's on_failure), at once."""
        self.death = f"rank {rank} (pid {pid}) failed: {text}"
        logger.error("the engine's %s", self.death)

    def alive(self) -> bool:
        """False as soon as the supervisor has seen a rank fail (not only once every rank has ended)."""
        return self._thread.is_alive() and self.death is None

    def _gone(self) -> EngineError:
        """The error for a lost connection to rank 0: the rank that failed first, once the supervisor
        has seen it (it sees a process exit at once; waited for up to a second)."""
        self._wait_for_death(1.0)
        return EngineError(f"the engine's {self.death}" if self.death else "rank 0 of the engine is gone (its connection closed)")

    def _wait_for_death(self, seconds: float) -> bool:
        """Whether the supervisor has seen a rank fail, waiting up to `seconds` for it (it sees a process exit at once)."""
        deadline = time.monotonic() + seconds
        while self.death is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.death is not None

    def _recv(self):
        while not self._conn.poll(0.05):
            if self.death is not None:  # a rank died during the step: the step fails, named (the driver restarts the ranks)
                raise StepFailed(f"the engine's {self.death}", f"the engine's {self.death}")
            if not self._thread.is_alive():
                raise EngineError(f"the engine's ranks ended: {self.failure}")
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:  # rank 0 is gone: after a peer that died first, the step fails (restartable)
            if self._wait_for_death(1.0) and not self.death.startswith("rank 0 "):
                raise StepFailed(f"the engine's {self.death}", f"the engine's {self.death}") from exc
            raise self._gone() from exc
        if message[0] == "error":  # the plan raised on rank 0 (after a failure of its own or of a peer)
            # a peer died: rank 0's error is the consequence
            if self._wait_for_death(1.0) and not self.death.startswith("rank 0 "):
                raise StepFailed(f"the engine's {self.death}; rank 0: {message[1]}", f"the engine's {self.death}")
            raise StepFailed(f"a step failed on rank 0: {message[1]}", _first_line(f"a step failed on rank 0: {message[1]}"))
        return message

    def run(self, plan, masks=None) -> StepOutcome:
        """Rank 0's outcome of `plan`. masks: None, or a callable giving the plan's structured-output
        StepMasks (or None), sent to rank 0 as the message after the plan, which rank 0 reads when it
        samples (engine.structured). It is called after the plan has gone, while the ranks run it, where
        overlap_masks(config) says a core is free for it; else before the plan leaves."""
        if self.death is not None:
            raise self._gone()
        overlap = masks is not None and overlap_masks(self.config)
        step_masks = masks() if masks is not None and not overlap else None
        try:
            self._conn.send_bytes(encode(plan))  # the plan's one encoding, made here once; rank 0 relays it
            if overlap:
                step_masks = masks()
            if step_masks is not None:  # the same encoding: rank 0 reads it when it samples
                self._conn.send_bytes(encode(step_masks))
        except OSError as exc:
            raise self._gone() from exc
        return self._recv()[1]

    def close(self) -> None:
        try:
            self._conn.send_bytes(encode(None))
        except (OSError, ValueError):  # gone, or closed by an earlier close
            pass
        if self.death is not None:  # a rank failed: the group is broken, so the others end now, not after spawn's grace
            self._processes.abandon()
        self._thread.join()
        self._conn.close()
        self._listener.close()


class GroupChannel:
    """An Engine inside an existing process group: rank 0 drives, every rank runs its share."""

    restartable = False

    def __init__(self, model, config: EngineConfig, group) -> None:
        if config.threads_per_rank is not None:  # this process is the rank (nproc=1, or torchrun's): its torch threads
            torch.set_num_threads(config.threads_per_rank)
        layout = helix_layout(config, group) if config.tp is not None else None
        model = load_model(model, config.dtype, _group_device(model, config, group), config.weight_format, layout)
        self.group = group
        self.runner = make_runner(model, config, group)
        self.info = model_info(model, self.runner)
        self.wire = PlanWire(plan_device(group))  # rank 0's end; the others' is in serve_steps
        if group is None or dist.get_rank(group) == 0:  # its steps run in the engine's driver thread, not this one:
            release_thread_pool()  # one OpenMP pool, whose workers spin between regions (ops.openmp), not two that sleep

    def serve(self) -> None:
        serve_steps(self.runner, None, None)

    def alive(self) -> bool:
        return True

    def run(self, plan, masks=None) -> StepOutcome:
        """Rank 0's outcome of `plan`; masks (SpawnedRanks.run's) are filled when this rank samples."""
        self.runner.receive_masks = masks
        return run_plan(self.runner, self.wire.broadcast(plan, 0, self.group))

    def close(self) -> None:
        self.wire.broadcast(None, 0, self.group)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


def _group_device(model, config: EngineConfig, group) -> torch.device:
    """This process's device in GroupChannel: one rank keeps a loaded model on its own device of the
    asked kind (a checkpoint goes to the current CUDA device, or the CPU); in a group, rank r takes
    rank_device (cuda:LOCAL_RANK under torchrun)."""
    in_group = dist.is_available() and dist.is_initialized()
    if not in_group and not isinstance(model, (str, os.PathLike)) and model.device.type == config.device:
        return model.device
    return rank_device(config.device, dist.get_rank() if in_group else 0)
