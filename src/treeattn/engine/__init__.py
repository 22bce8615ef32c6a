"""The decoding engine: many requests over a KV cache sharded across ranks, and generate() on top.

The public face (also at the top level: ta.Engine, ta.generate, ...):

    Engine, RequestHandle (client.py)   many requests at once over the sharded KV cache
    EngineConfig (config.py)            how an engine runs, validated once where its fields live
    SamplingParams, TokenEvent,         what a request asks for and what comes back (request.py)
    TokenLogprob, RequestResult
    EngineError (errors.py)             the engine cannot go on; ConfigError: a bad option, named
    RankMeasurements (measure.py)       what each rank communicated and held (engine.rank_measurements)
    generate, stream (generate.py)      one batch of prompts from prefill to the last token, inside a group

Inside, one job per module:

    checks.py       what a rank would refuse, checked before any rank starts
    driver.py       the driver thread: plans each step (scheduler.py), runs it, emits events
    output.py       each request's handle, detokenizing, stop strings, result
    transport.py    the driver's line to the ranks: spawned processes, or an existing group
    worker/         what runs on every rank: rank.py's loop over the plans, runner.py runs a plan,
                    batch.py, static_step.py, ring_prefill.py, token_parallel.py, shared_prefix.py,
                    draft.py (the draft model), sampling.py, tensor_parallel.py
    speculate.py, draft_model.py                           speculative decoding: the driver's drafters
                                                           (NgramDrafter, DraftSlots), the draft model's checks

The terminal commands (`treeattn generate`, `treeattn chat`) live in treeattn.commands.

    from treeattn.engine import EngineConfig
    config = EngineConfig(nproc=2, decode="tree", max_batch_size=8)
"""

from treeattn.engine.client import Engine
from treeattn.engine.config import EngineConfig
from treeattn.engine.measure import RankMeasurements
from treeattn.engine.output import RequestHandle
from treeattn.engine.errors import EngineError
from treeattn.engine.request import RequestResult, SamplingParams, TokenEvent, TokenLogprob

__all__ = ["Engine", "EngineConfig", "EngineError", "RankMeasurements", "RequestHandle", "RequestResult", "SamplingParams",
           "TokenEvent", "TokenLogprob"]
