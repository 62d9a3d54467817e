"""Running the app under uvicorn: in the foreground (`serve`, with graceful SIGTERM) or on a
background thread (`BackgroundServer`, for tests, benchmarks and notebooks).

Shutdown (SIGTERM/SIGINT, or `BackgroundServer.stop`): stop accepting, let running requests run
for up to `shutdown_timeout_s`, then abort those left (`EngineLoop.begin_drain`): each gets its
final chunk or error response and `[DONE]`, and one log line says how many were aborted. uvicorn's
own limit, after which it cancels the handlers (with a traceback each), is `_FLUSH_S` later, so
it only fires for a client that stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from metrale_jax.server.app import ServerConfig, create_app

log = logging.getLogger(__name__)

_FLUSH_S = 2.0  # after the drain limit: time for the aborted requests' last chunks to reach their clients


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown starts (so /health and new requests say 503)
    and exiting with status 0 after a graceful shutdown instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_s: float):
        super().__init__(config)
        self._app = app
        self.drain_s = drain_s

    def begin_shutdown(self) -> None:
        """Say 503 to new requests, and abort the running ones after the drain limit."""
        self._app.state.shutting_down = True
        self._app.state.engine_loop.begin_drain(self.drain_s)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            log.info("received signal %d: stop accepting, finish running requests (up to %g s), exit",
                     sig, self.drain_s)
            self.begin_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in original.items():
                signal.signal(s, h)


def _uvicorn_config(app: Any, host: str, port: int, shutdown_timeout_s: float, log_level: str,
                    **tls_and_root: Any) -> uvicorn.Config:
    """`tls_and_root`: uvicorn's ssl_keyfile, ssl_certfile (HTTPS) and root_path (vLLM's flags)."""
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s + _FLUSH_S,
        **tls_and_root,
        access_log=False,  # the app writes one access line per request itself (app.py)
        lifespan="on", timeout_keep_alive=5,
        # More simultaneous connections than the waiting bound, so overload gets a 503, not a refusal.
        backlog=4096,
    )


def serve(engine: Any, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout_s: float = 30.0, log_level: str = "info", ssl_keyfile: str | None = None,
          ssl_certfile: str | None = None, root_path: str = "") -> None:
    """Serve `engine` until SIGINT/SIGTERM: stop accepting, let running requests finish for up to
    `shutdown_timeout_s` seconds (then abort them, each stream ending with a finish_reason "abort"
    chunk and `[DONE]`), stop the engine thread, return. HTTPS with `ssl_keyfile` and `ssl_certfile`;
    `root_path` behind a path-based proxy."""
    app = create_app(engine, config)
    cfg = _uvicorn_config(app, host, port, shutdown_timeout_s, log_level, ssl_keyfile=ssl_keyfile,
                          ssl_certfile=ssl_certfile, root_path=root_path)
    server = _Server(cfg, app, shutdown_timeout_s)
    server.run()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The app on a uvicorn server in a daemon thread; `url` is its base URL.

    with BackgroundServer(engine, ServerConfig(...)) as srv:
        httpx.get(srv.url + "/health")
    """

    def __init__(self, engine: Any, config: ServerConfig = ServerConfig(), *, host: str = "127.0.0.1",
                 port: int | None = None, shutdown_timeout_s: float = 5.0, log_level: str = "warning"):
        self.app = create_app(engine, config)
        self.host = host
        self.port = port or free_port(host)
        self.server = _Server(_uvicorn_config(self.app, host, self.port, shutdown_timeout_s, log_level), self.app,
                              shutdown_timeout_s)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_loop(self):
        return self.app.state.engine_loop

    def start(self, timeout_s: float = 60.0) -> BackgroundServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), name="metrale-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread is None:
            return
        self.server.begin_shutdown()
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
