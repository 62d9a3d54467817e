"""The engine loop: one background thread that owns the (single-threaded) `LLMEngine`.

HTTP handlers live on the asyncio event loop; the engine lives on its own thread. They meet in
two places only:

- a thread-safe command queue (add / abort / stop) that the engine thread drains between steps;
- `loop.call_soon_threadsafe`, through which the engine thread hands each step's outputs back to
  the event loop in one callback per step.

Engine outputs are cumulative (full text and token ids so far), so a subscription only keeps the
latest output per request: a slow client gets coalesced updates instead of a growing backlog.

Shutdown: `begin_drain(limit_s)` (from the signal handler, any thread) stops new submissions and
gives the running requests `limit_s` seconds; then every one still running is aborted in the
engine and its subscription ends with `DrainTimeoutError`, so each HTTP handler can still send a
final chunk (finish_reason "abort") and `[DONE]` before the server closes. One log line says so.

Backpressure: the number of waiting requests (added but not yet running in the engine, plus those
still in the command queue) is bounded by `max_waiting`; past it `submit` raises `QueueFullError`
at once, and the HTTP layer answers 503 with Retry-After. A group larger than the bound on its own
(a batch of prompts, or a beam search's round) could never be queued, so it is `BatchTooLargeError`
instead: a 400, not a 503 to retry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from metrale_jax.errors import InvalidRequestError

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its bound; retry later (HTTP 503)."""


class BatchTooLargeError(InvalidRequestError):
    """One group of requests larger than the whole waiting bound: no retry can succeed (HTTP 400)."""

    code = "batch_too_large"


class ServerStoppingError(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


class DrainTimeoutError(ServerStoppingError):
    """The shutdown drain limit passed while the request ran; it was aborted."""


class EngineDeadError(Exception):
    """The engine thread died (an engine step raised); the server cannot serve (HTTP 500)."""


@dataclass
class StatsSnapshot:
    """The engine's counters as last read on the engine thread (duck-typed copy of EngineStats)."""

    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    ssm_slots_total: int = 0
    ssm_slots_used: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @staticmethod
    def read(engine: Any, num_steps: int) -> StatsSnapshot:
        s = engine.stats()
        names = [f for f in StatsSnapshot.__dataclass_fields__ if f != "num_steps"]
        return StatsSnapshot(**{n: int(getattr(s, n, 0) or 0) for n in names}, num_steps=num_steps)


@dataclass
class _Tracked:
    """Per engine request timing, for the TTFT / inter-token latency histograms."""

    arrival: float
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)  # output index -> time of its last token


class Subscription:
    """The outputs of a group of engine requests that one HTTP request made (one per prompt).

    Iterate `updates()` on the event loop: each item is the list of outputs that changed since the
    last item (one DELTA output per request: the engine's deltas since the last item, joined).
    It ends when every request has finished.
    """

    def __init__(self, owner: EngineLoop, request_ids: Sequence[str]):
        self._owner = owner
        self.request_ids = list(request_ids)
        self._latest: dict[str, Any] = {}
        self._changed: list[str] = []
        self._unfinished = set(self.request_ids)
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _push(self, out: Any) -> None:
        rid = out.request_id
        if rid not in self._changed:
            self._changed.append(rid)
            self._latest[rid] = out
        else:  # the reader has not taken the previous delta yet
            self._latest[rid].add(out)
        if out.finished:
            self._unfinished.discard(rid)
        self._event.set()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._unfinished.clear()
        self._event.set()

    async def updates(self) -> AsyncIterator[list[Any]]:
        while True:
            await self._event.wait()
            self._event.clear()
            if self._changed:
                batch = [self._latest[r] for r in self._changed]
                self._changed = []
                yield batch
            if self._error is not None:
                raise self._error
            if not self._unfinished:
                return

    def abort(self) -> None:
        """Abort every unfinished request of the group (idempotent). Call on the event loop."""
        if self._unfinished:
            self._owner._abort(sorted(self._unfinished))
            self._unfinished.clear()
            self._event.set()


class EngineLoop:
    """Runs an `LLMEngine` on one background thread and feeds asyncio subscribers.

    engine: an LLMEngine (or anything with its add_request / step / abort /
      has_unfinished_requests / stats methods). Only the engine thread touches it after `start`.
    max_waiting: the bound on waiting requests (see the module docstring). Mutable at run time.
    metrics: a `ServerMetrics` to observe TTFT / inter-token latency / finished requests, or None.
    """

    def __init__(self, engine: Any, *, max_waiting: int = 1024, metrics: Any = None):
        if max_waiting < 1:
            raise ValueError(f"{max_waiting=} must be >= 1")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._cmds: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued_adds = 0  # requests accepted by submit() that the engine thread has not added yet
        self._stats = StatsSnapshot()
        self._subs: dict[str, Subscription] = {}  # request id -> subscription; event-loop side only
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._steps = 0
        self._live: set[str] = set()  # request ids added to the engine and not finished; engine thread only
        self._drain_timer: asyncio.TimerHandle | None = None

    # ---- event-loop side --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running loop)."""
        if self._thread is not None:
            raise RuntimeError("EngineLoop already started")
        self._loop = loop or asyncio.get_running_loop()
        self._stats = StatsSnapshot.read(self.engine, 0)
        self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stats(self) -> StatsSnapshot:
        """The latest engine counters (read on the engine thread after its last step)."""
        return self._stats

    def num_waiting(self) -> int:
        with self._lock:
            return self._queued_adds + self._stats.num_waiting

    async def submit(self, requests: Sequence[tuple[str, Any, Any]]) -> Subscription:
        """Add (request_id, prompt, SamplingParams[, LoRARequest]) requests as one group.

        Raises QueueFullError / ServerStoppingError / EngineDeadError, BatchTooLargeError (the group
        alone exceeds `max_waiting`), or the engine's InvalidRequestError when it rejects one of them
        (then none of the group stays queued).
        """
        if self.error is not None or not self.alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        if self._stopping:
            raise ServerStoppingError("the server is shutting down")
        for rid, *_ in requests:
            if rid in self._subs:
                raise ValueError(f"duplicate request id {rid!r}")
        if len(requests) > self.max_waiting:
            raise BatchTooLargeError(f"the request makes {len(requests)} engine requests at once (one per prompt, "
                                     f"or per beam of a beam search), more than this server's bound of "
                                     f"{self.max_waiting} waiting requests (--max-waiting-requests): send fewer "
                                     f"prompts per request")
        with self._lock:
            if self._queued_adds + self._stats.num_waiting + len(requests) > self.max_waiting:
                raise QueueFullError(f"{self._queued_adds + self._stats.num_waiting} requests are waiting "
                                     f"(the bound is {self.max_waiting})")
            self._queued_adds += len(requests)
        sub = Subscription(self, [r[0] for r in requests])
        now = time.monotonic()
        for rid, *_ in requests:
            self._subs[rid] = sub
            self._tracked[rid] = _Tracked(arrival=now)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("add", list(requests), fut))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            for rid, *_ in requests:
                self._subs.pop(rid, None)
                self._tracked.pop(rid, None)
            if not fut.done() or fut.cancelled() or fut.exception() is None:
                # Cancelled while the engine thread was adding: make sure nothing stays queued.
                self._cmds.put(("abort", [r[0] for r in requests]))
            raise
        return sub

    def _abort(self, request_ids: Sequence[str]) -> None:
        if self.metrics is not None:
            self.metrics.aborted.inc(len(request_ids))
        for rid in request_ids:
            self._subs.pop(rid, None)
            self._tracked.pop(rid, None)
        self._cmds.put(("abort", list(request_ids)))

    def _deliver(self, outputs: list[Any], now: float) -> None:
        """Route one step's outputs to their subscriptions (runs on the event loop)."""
        m = self.metrics
        for out in outputs:
            rid = out.request_id
            sub = self._subs.get(rid)
            if sub is None:
                continue  # aborted meanwhile
            tr = self._tracked.get(rid)
            if tr is not None and m is not None:
                for o in out.outputs:
                    n_new = len(o.token_ids)  # a DELTA output: its new tokens
                    if n_new <= 0:
                        continue
                    if tr.first_token is None:
                        tr.first_token = now
                        m.ttft.observe(now - tr.arrival)
                    elif o.index in tr.last_token:
                        gap = (now - tr.last_token[o.index]) / n_new
                        for _ in range(n_new):
                            m.itl.observe(gap)
                    tr.last_token[o.index] = now
            sub._push(out)
            if out.finished:
                self._subs.pop(rid, None)
                self._tracked.pop(rid, None)
                if m is not None and tr is not None:
                    m.e2e.observe(now - tr.arrival)
                    for o in out.outputs:
                        m.finished.labels(finish_reason=str(o.finish_reason or "abort")).inc()

    def begin_drain(self, limit_s: float) -> None:
        """Shutdown began: take no new requests, and abort those still running after `limit_s`
        seconds (`DrainTimeoutError` to their subscribers). Callable from any thread, once or more."""
        self._stopping = True
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._arm_drain, limit_s)
        except RuntimeError:
            pass  # the event loop is closing already

    def _arm_drain(self, limit_s: float) -> None:
        if self._drain_timer is None:
            self._drain_timer = asyncio.get_running_loop().call_later(limit_s, self._drain_expired, limit_s)

    def _drain_expired(self, limit_s: float) -> None:
        """Abort every running request (on the event loop; one log line)."""
        subs = set(self._subs.values())
        rids = sorted(r for sub in subs for r in sub._unfinished)
        if not rids:
            return
        err = DrainTimeoutError(f"the server is shutting down: the request was aborted after the drain limit of "
                                f"{limit_s:g} s")
        for sub in subs:
            sub._fail(err)
        self._abort(rids)
        log.warning("shutdown: the drain limit of %g s passed; aborted %d running request(s)", limit_s, len(rids))

    def _fail_all(self, err: BaseException) -> None:
        for sub in set(self._subs.values()):
            sub._fail(err)
        self._subs.clear()
        self._tracked.clear()

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running, stop the engine thread and wait for it (bounded)."""
        self._stopping = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._thread is None:
            return
        self._fail_all(ServerStoppingError("the server is shutting down"))
        self._cmds.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1f s", timeout)

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        loop = self._loop
        assert loop is not None
        try:
            while True:
                busy = eng.has_unfinished_requests()
                cmds = self._drain(block=not busy)
                stop = False
                n_added = 0
                for cmd in cmds:
                    if cmd[0] == "add":
                        n_added += len(cmd[1])
                        self._add_group(cmd[1], cmd[2])
                    elif cmd[0] == "abort":
                        for rid in cmd[1]:
                            if rid in self._live:
                                eng.abort(rid)
                                self._live.discard(rid)
                    elif cmd[0] == "stop":
                        stop = True
                if stop:
                    self._abort_everything()
                    return
                outputs = []
                if eng.has_unfinished_requests():
                    outputs = eng.step()
                    self._steps += 1
                    for out in outputs:
                        if out.finished:
                            self._live.discard(out.request_id)
                self._refresh_stats(n_added)
                if outputs:
                    loop.call_soon_threadsafe(self._deliver, outputs, time.monotonic())
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail every request, not hang them
            log.exception("engine step failed; the engine loop stops")
            self.error = e
            with self._lock:
                self._queued_adds = 0
            # Fail the commands nobody will run.
            for cmd in self._drain(block=False):
                if cmd[0] == "add" and not cmd[2].done():
                    cmd[2].set_exception(EngineDeadError(f"engine failed: {e!r}"))
            try:
                loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine failed: {e!r}"))
            except RuntimeError:
                pass  # the event loop is closed already

    def _drain(self, block: bool) -> list[tuple]:
        cmds = []
        if block:
            while True:
                try:
                    cmds.append(self._cmds.get(timeout=0.5))
                    break
                except queue.Empty:
                    continue
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _add_group(self, requests: list[tuple[str, Any, Any]], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the handler was cancelled before we got here
        added = []
        try:
            # (optional 4th and 5th items: the LoRARequest, the priority)
            for rid, prompt, params, *extra in requests:
                kw = {}
                if extra and extra[0] is not None:
                    kw["lora_request"] = extra[0]
                if len(extra) > 1 and extra[1]:
                    kw["priority"] = extra[1]
                self.engine.add_request(rid, prompt, params, **kw)
                added.append(rid)
        except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
            for rid in added:
                self.engine.abort(rid)
            fut.set_exception(e)
            return
        self._live.update(added)
        fut.set_result(None)

    def _refresh_stats(self, n_added: int) -> None:
        stats = StatsSnapshot.read(self.engine, self._steps)
        with self._lock:
            self._stats = stats
            self._queued_adds -= n_added

    def _abort_everything(self) -> None:
        for rid in sorted(self._live):
            self.engine.abort(rid)
        self._live.clear()
        if self.engine.has_unfinished_requests():
            self.engine.step()  # aborts take effect by the next step
