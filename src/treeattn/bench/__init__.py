"""Benchmarks: decode sweeps on real process groups, calibration, cost-model validation, plots.

    config       SweepConfig: methods x world sizes x sequence lengths, validated up front
    runner       run_decode_sweep: barrier-aligned timing, slowest-rank median/p10/p90,
                 comm_stats bytes and rounds, peak memory per rank; JSON/CSV records
    calibrate    measure this machine -> the cost model's "cpu-local" cluster
    validate     predicted vs measured latencies
    netns        two-tier topology from Linux network namespaces (root + iproute2)
    worker       one benchmark rank as its own process (used inside namespaces)
    plots        figures in the style of the paper's figures 4-5
    cli          `treeattn bench decode | calibrate | validate | plot`
"""

from treeattn.bench.config import METHODS, SweepConfig
from treeattn.bench.runner import run_decode_sweep, write_records

__all__ = ["METHODS", "SweepConfig", "run_decode_sweep", "write_records"]
