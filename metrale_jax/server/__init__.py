"""The OpenAI-compatible HTTP server (`metrale serve`).

`create_app(engine, ServerConfig(...))` builds the FastAPI app; `serve(...)` runs it under uvicorn
with graceful SIGTERM; `BackgroundServer` runs it on a thread (tests, benchmarks, notebooks).
"""

from metrale_jax.server.app import ServerConfig, create_app
from metrale_jax.server.runner import BackgroundServer, free_port, serve

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "free_port", "serve"]
