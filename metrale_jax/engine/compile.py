"""The compilation manager: every (step kind, bucket) the engine can run, compiled ahead of time.

At start-up `compile_all` lowers and compiles each bucket's step once (and, when preemption
swaps, the gather / scatter pair of each swap block bucket, `metrale_jax.engine.swap`)
(`jax.jit(...).lower(abstract args).compile()`), a few at a time in threads, with a progress bar,
going through JAX's persistent compilation cache. Serving then only ever calls those executables:
a shape that is not a listed bucket raises instead of compiling, so a compile while serving
cannot happen silently. `CompileCounter` counts compilations (for tests and logs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
from tqdm.auto import tqdm

from metrale_jax.engine.config import EngineConfig
from metrale_jax.metadata_builder import BuilderConfig, StepBucket, StepInputs, pack, packed_layout
from metrale_jax.sampling import F_FILTER, F_LOGPROBS
from metrale_jax.step import jit_packed_step

log = logging.getLogger(__name__)

_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts JAX lowerings and backend compilations while active (a context manager).

    `lowerings` counts every new trace-and-lower (also those then served from the persistent
    cache); `backend_compiles` those that ran the XLA compiler.
    """

    def __init__(self) -> None:
        self.lowerings = 0
        self.backend_compiles = 0
        self._lock = threading.Lock()

    def _on(self, event: str, duration: float, **kw) -> None:
        with self._lock:
            if event == _LOWER_EVENT:
                self.lowerings += 1
            elif event == _BACKEND_EVENT:
                self.backend_compiles += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on)


def setup_compilation_cache(cache_dir: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache at `cache_dir` unless one is already set.

    Returns the directory in use (None = off)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if cache_dir is None:
        return None
    path = os.path.expanduser(cache_dir)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def list_buckets(cfg: EngineConfig) -> list[StepBucket]:
    """Every bucket of a resolved config: decode N's (and their lean twins when
    `cfg.lean_decode_steps`), prefill T's, and mixed (N, T) pairs."""
    b = cfg.max_prefill_streams
    out = [StepBucket("decode", num_seqs=n) for n in cfg.decode_buckets]
    if cfg.lean_decode_steps:
        out += [StepBucket("decode", num_seqs=n, lean=True) for n in cfg.decode_buckets]
    out += [StepBucket("prefill", num_tokens=t, num_streams=b) for t in cfg.prefill_buckets]
    out += [StepBucket("mixed", num_seqs=n, num_tokens=t, num_streams=b)
            for n in cfg.mixed_decode_buckets for t in cfg.prefill_buckets]
    return out


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class CompilationManager:
    """Holds one executable per bucket of `cfg` (resolved) for `model`."""

    def __init__(self, model, cfg: EngineConfig, builder: BuilderConfig):
        self.model = model
        self.cfg = cfg
        self.builder = builder
        self.buckets = list_buckets(cfg)
        self.max_rows = max(b.num_sample_rows for b in self.buckets)  # width of next_tokens
        self.executables: dict[StepBucket, jax.stages.Compiled] = {}
        self.swap_roles = None  # set by compile_all when cfg.preemption_mode == "swap"
        self.swap_executables: dict[tuple[str, int], jax.stages.Compiled] = {}  # ("gather"|"scatter", M)
        self.compile_seconds = 0.0
        self.temp_bytes = 0  # the largest executable's scratch memory

    def _static(self) -> dict:
        return dict(model=self.model, attn=self.cfg.attention, max_logprobs=self.cfg.max_logprobs,
                    prompt_lp_chunk=self.cfg.prompt_logprobs_chunk)

    def lower(self, bucket: StepBucket, params, state):
        p = jax.tree.map(_abstract, params)
        s = jax.tree.map(_abstract, state)
        layout = packed_layout(self.builder, bucket)
        ibuf = jax.ShapeDtypeStruct((layout.num_i32,), jax.numpy.int32)
        fbuf = jax.ShapeDtypeStruct((layout.num_f32,), jax.numpy.float32)
        prev = jax.ShapeDtypeStruct((self.max_rows,), jax.numpy.int32)
        return jit_packed_step(bucket.kind).lower(p, s, ibuf, fbuf, prev, layout=layout, lean=bucket.lean,
                                                  **self._static())

    def lower_swap(self, kind: str, m: int, state):
        """Lower the swap `kind` ("gather" | "scatter") for block bucket `m`."""
        from metrale_jax.engine.swap import jit_gather, jit_scatter

        s = jax.tree.map(_abstract, state)
        blocks = jax.ShapeDtypeStruct((m,), jax.numpy.int32)
        slot = jax.ShapeDtypeStruct((), jax.numpy.int32)
        if kind == "gather":
            return jit_gather().lower(s, blocks, slot, roles=self.swap_roles)
        saved = jax.eval_shape(functools.partial(jit_gather(), roles=self.swap_roles), s, blocks, slot)
        return jit_scatter().lower(s, blocks, slot, saved, roles=self.swap_roles)

    def compile_all(self, params, state) -> float:
        """Compile every bucket (and swap pair); returns the wall time in seconds."""
        t0 = time.perf_counter()
        todo = [b for b in self.buckets if b not in self.executables]
        if self.cfg.preemption_mode == "swap":
            from metrale_jax.engine.swap import swap_roles

            self.swap_roles = swap_roles(self.model, state.model)
            todo += [(k, m) for m in self.cfg.swap_block_buckets for k in ("gather", "scatter")
                     if (k, m) not in self.swap_executables]

        def one(bucket):
            if isinstance(bucket, tuple):
                return bucket, self.lower_swap(*bucket, state).compile()
            return bucket, self.lower(bucket, params, state).compile()

        workers = max(1, min(self.cfg.compile_workers, len(todo)))
        bar = tqdm(total=len(todo), desc="compiling steps", unit="exe", disable=not self.cfg.show_progress)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for fut in concurrent.futures.as_completed([pool.submit(one, b) for b in todo]):
                bucket, exe = fut.result()
                if isinstance(bucket, tuple):
                    self.swap_executables[bucket] = exe
                    bar.update(1)
                    continue
                self.executables[bucket] = exe
                try:
                    mem = exe.memory_analysis()
                    self.temp_bytes = max(self.temp_bytes, int(getattr(mem, "temp_size_in_bytes", 0) or 0))
                except Exception:  # noqa: BLE001 - memory analysis is optional per backend
                    pass
                bar.update(1)
                bar.set_postfix_str(str(bucket))
        bar.close()
        self.compile_seconds = time.perf_counter() - t0
        log.info("compiled %d step executables in %.1fs (largest scratch %.1f MB)", len(todo),
                 self.compile_seconds, self.temp_bytes / 1e6)
        return self.compile_seconds

    # ---- bucket choice ---------------------------------------------------------------------------
    def bucket_for(self, num_decode: int, num_prefill_tokens: int, num_streams: int) -> StepBucket:
        c = self.cfg
        if num_streams > c.max_prefill_streams:
            raise ValueError(f"{num_streams} prefill streams exceed max_prefill_streams")
        if num_prefill_tokens == 0:
            return StepBucket("decode", num_seqs=_ceil_bucket(c.decode_buckets, num_decode))
        t = _ceil_bucket(c.prefill_buckets, num_prefill_tokens)
        if num_decode == 0:
            return StepBucket("prefill", num_tokens=t, num_streams=c.max_prefill_streams)
        n = _ceil_bucket(c.mixed_decode_buckets, num_decode)
        return StepBucket("mixed", num_seqs=n, num_tokens=t, num_streams=c.max_prefill_streams)

    def runnable(self, inputs: StepInputs) -> StepBucket:
        """The executable's bucket for built step `inputs`: its decode bucket's lean twin when
        compiled and no row needs top-k/top-p or logprobs (`sampling.sample`), else its own."""
        b = inputs.bucket
        flags = inputs.smd.flags
        if b.kind == "decode" and self.cfg.lean_decode_steps and not (flags[F_FILTER] or flags[F_LOGPROBS]):
            return dataclasses.replace(b, lean=True)
        return b

    def run(self, bucket: StepBucket, params, state, dev_inputs: tuple, prev_tokens=None):
        """Run the executable of `bucket` on its packed device inputs (i32 buffer, f32 buffer) and
        the previous step's `next_tokens` (zeros when None). Returns (state, out, next_tokens)."""
        exe = self.executables.get(bucket)
        if exe is None:
            raise RuntimeError(f"step bucket {bucket} was not compiled at start-up (a bug)")
        if prev_tokens is None:
            prev_tokens = self.zero_tokens()
        return exe(params, state, *dev_inputs, prev_tokens)

    def swap_bucket(self, num_blocks: int) -> int:
        return _ceil_bucket(self.cfg.swap_block_buckets, num_blocks)

    def swap_out(self, state, blocks: list[int], slot: int):
        """Start copying one sequence's `blocks` and SSM `slot` (-1 = none) of `state` to the
        host (not donated). Returns its `SwapData` (device arrays until `.to_host`)."""
        import numpy as np

        from metrale_jax.engine.swap import SwapData

        m = self.swap_bucket(max(1, len(blocks)))
        b = np.zeros(m, np.int32)
        b[: len(blocks)] = blocks
        arrays = self.swap_executables[("gather", m)](state, b, np.int32(slot))
        for a in arrays:
            a.copy_to_host_async()
        return SwapData(m, len(blocks), tuple(arrays))

    def swap_in(self, state, data, blocks: list[int], slot: int):
        """Write `data` (a `SwapData`) into new `blocks` (as many as it saved) and SSM `slot` of
        `state` (donated); returns the new state."""
        import numpy as np

        if len(blocks) != data.num_blocks:
            raise ValueError(f"{len(blocks)} blocks to restore {data.num_blocks} saved ones")
        m = self.swap_bucket(max(1, len(blocks))) if data.on_host else data.bucket
        b = np.full(m, -1, np.int32)
        b[: len(blocks)] = blocks
        return self.swap_executables[("scatter", m)](state, b, np.int32(slot), data.padded(self.swap_roles, m))

    def zero_tokens(self):
        import numpy as np

        return jax.device_put(np.zeros(self.max_rows, np.int32))

    def transfer(self, inputs: StepInputs) -> tuple:
        """Pack a step's inputs and send them to the device in one transfer."""
        _, ibuf, fbuf = pack(self.builder, inputs)
        return jax.device_put((ibuf, fbuf))


def _ceil_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
