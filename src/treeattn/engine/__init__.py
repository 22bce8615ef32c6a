"""The decoding engine: what one generation is (GenerationConfig, validated once), and the
per-rank worker that runs it.

    from treeattn.engine.config import GenerationConfig
    config = GenerationConfig(max_new_tokens=64, decode="tree", top_p=0.9, temperature=0.7)

Submodules are imported where they are used; this package imports nothing at start-up.
"""
