"""treeattn.serve: an OpenAI-compatible HTTP server over ta.Engine (FastAPI + uvicorn, SSE streaming).

    treeattn serve MODEL --nproc 4 --port 8000
    from treeattn.serve.app import ServerConfig, create_app     # the ASGI app, to mount elsewhere

Imported only by the `serve` command (FastAPI and uvicorn are not loaded by the rest of treeattn).
"""
