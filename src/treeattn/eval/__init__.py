"""Evaluations of real models through the engine (imported only by `treeattn eval` and `treeattn demo`).

    haystack.py   needle-in-a-haystack prompts and exact-retrieval scoring
    runner.py     decode prompts with several methods from one prefill each, on p local ranks
    needle.py     the length x depth grid, its report and heatmap
    cli.py        `treeattn eval needle MODEL`
"""
