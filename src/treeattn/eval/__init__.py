"""Evaluations of real models through the engine (imported only by `treeattn eval` and `treeattn demo`).

    haystack.py   needle-in-a-haystack prompts and exact-retrieval scoring
    runner.py     decode prompts with several methods from one prefill each, on p local ranks
    needle.py     the length x depth grid, its report and heatmap
    cli.py        `treeattn eval needle MODEL`
    demo.py       the document demo of `treeattn demo`: SmolLM2 answers a question hidden in a long document
    synthetic.py  the synthetic demo of `treeattn demo --synthetic`: a random-weight Llama, 32K tokens
    demo_cli.py   `treeattn demo`: runs one of the two and renders its table
"""
