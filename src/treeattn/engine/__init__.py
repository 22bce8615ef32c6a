"""The decoding engine.

    ta.Engine (engine.py)              many requests at once over the sharded KV cache: the driver
    SamplingParams, TokenEvent,        what a request asks for and what comes back (request.py)
    TokenLogprob, RequestResult
    Scheduler (scheduler.py)           continuous batching, chunked prefill, preemption, prefix reuse
    RankRunner (runner.py)             one rank's side of an engine step
    RankMeasurements (measure.py)      what each rank communicated and held (engine.rank_measurements)
    GenerationConfig (config.py)       what one ta.generate run is, validated once
    generate_rank.py                   the per-rank worker of `treeattn generate`

    from treeattn.engine.config import GenerationConfig
    config = GenerationConfig(max_new_tokens=64, decode="tree", top_p=0.9, temperature=0.7)
"""

from treeattn.engine.engine import Engine, EngineConfig, EngineError, RequestHandle
from treeattn.engine.measure import RankMeasurements
from treeattn.engine.request import RequestResult, SamplingParams, TokenEvent, TokenLogprob

__all__ = ["Engine", "EngineConfig", "EngineError", "RankMeasurements", "RequestHandle", "RequestResult", "SamplingParams", "TokenEvent", "TokenLogprob"]
