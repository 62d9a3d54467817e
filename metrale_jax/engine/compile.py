"""The compilation manager: every (step kind, bucket) the engine can run, compiled ahead of time.

At start-up `compile_all` lowers and compiles each bucket's step once (and, when preemption
swaps, the gather / scatter pair of each swap block bucket, `metrale_jax.engine.swap`)
(`jax.jit(...).lower(abstract args).compile()`), a few at a time in threads, with a progress bar,
going through JAX's persistent compilation cache. Serving then only ever calls those executables:
a shape that is not a listed bucket raises instead of compiling, so a compile while serving
cannot happen silently. `CompileCounter` counts compilations (for tests and logs).

Warm starts skip tracing too. JAX's persistent cache is keyed by the lowered module, so a warm
start still traces and lowers every bucket (about 1-1.5 s of Python each for a 32-layer step,
under the GIL). `ExecutableCache` keeps each compiled step serialized under a key computed
without tracing: the source files of `metrale_jax` and `pallas_kernels`, the jax/jaxlib (and
tokamax) versions, the device, XLA_FLAGS, the model config, the step's static configuration, the
bucket and the shapes, dtypes and shardings of every argument. A changed input is a new key.

`warm_up` then runs each executable once on padding inputs (which write nothing), so the first
requests pay no first-execution costs and a step that cannot run fails at start-up.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from metrale_jax.engine.config import EngineConfig
from metrale_jax.metadata_builder import BuilderConfig, StepBucket, StepInputs, build_step, pack, packed_layout
from metrale_jax.parallel import local
from metrale_jax.step import jit_packed_forward, jit_packed_sample, jit_packed_step

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
    if cache_dir is None or jax.default_backend() == "cpu":
        # Not on the CPU: in jax 0.11.2 an XLA:CPU executable read back from the cache can abort
        # the process (seen in the test suite, reading entries written earlier in the same run)
        return None
    path = os.path.expanduser(cache_dir)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


@functools.cache
def _source_digest() -> str:
    """sha256 over the engine's and the kernels' source files (and tuned tables)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for pkg in ("metrale_jax", "pallas_kernels"):
        for f in sorted((root / pkg).rglob("*")):
            if f.suffix in (".py", ".json") and f.is_file():
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _versions() -> str:
    import jaxlib

    mods = [f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}"]
    tk = sys.modules.get("tokamax")
    if tk is not None:
        mods.append(f"tokamax={getattr(tk, '__version__', '?')}")
    return ",".join(mods)


def _tree_signature(tree) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    shapes = ";".join(f"{x.shape}{x.dtype}{getattr(x, 'sharding', '')}" for x in leaves)
    return f"{treedef}|{shapes}"


# Platforms whose executables round-trip through `jax.experimental.serialize_executable`. Not the
# CPU: in jax 0.11.2 a deserialized XLA:CPU step fails at its first run ("Function
# add_select_fusion.2 not found"), so the CPU relies on JAX's persistent cache alone.
EXE_CACHE_PLATFORMS = ("gpu",)

# XLA's default command-buffer contents (xla/debug_options_flags.cc, jax 0.11) plus conditionals,
# which CUDA graphs then run as conditional nodes (the predicate read on the device): the step
# executables of `AttentionConfig.sampler_skip` (sampling.sample's `skip`) compile with it
COMMAND_BUFFER_WITH_CONDITIONALS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL"
PDL_OPTIONS = ("xla_gpu_enable_pdl", "xla_gpu_enable_pdl_launch")  # (`AttentionConfig.xla_pdl`)


def executable_cache_dir() -> str | None:
    """`<JAX's persistent cache dir>/metrale_executables` (None when that cache is off)."""
    root = jax.config.jax_compilation_cache_dir
    return os.path.join(root, "metrale_executables") if root else None


@functools.cache
def _link_mosaic_gpu_runtime() -> None:
    """Import JAX's Mosaic GPU module before deserializing: importing it sets
    MOSAIC_GPU_RUNTIME_LIB_PATH, which a Mosaic GPU custom call reads to link its kernel's host
    code against the runtime library. A process that deserializes a step holding a Mosaic kernel
    (the bf16 prefill attention) before it has lowered any otherwise fails to link it ("Failed to
    lookup host symbol ... paged_prefill_attention_mgpu_mosaic_gpu"): on the H200 (2026-12-01) a
    warm start recompiled 3 of its 8 prefill/mixed executables so, the others having loaded after
    a recompile's lowering had imported the module."""
    if jax.devices()[0].platform == "gpu":
        import importlib

        try:
            importlib.import_module("jax.experimental.mosaic.gpu")
        except ImportError:  # a jaxlib without Mosaic GPU: no such kernels either
            pass


class ExecutableCache:
    """Compiled steps serialized on disk (`<dir>/<key>.exe`), keyed without tracing (module doc).

    Loading is best effort: an unreadable or incompatible entry is a miss (and is replaced).
    Off (every call a miss, nothing written) without a directory or on other platforms than
    `EXE_CACHE_PLATFORMS`."""

    def __init__(self, directory: str | None):
        on = directory and jax.devices()[0].platform in EXE_CACHE_PLATFORMS
        self.dir = Path(directory) if on else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(*parts) -> str:
        dev = jax.devices()[0]
        h = hashlib.sha256()
        for p in (_source_digest(), _versions(), dev.platform, getattr(dev, "device_kind", ""),
                  os.environ.get("XLA_FLAGS", ""), str(jax.config.jax_enable_x64),
                  str(jax.config.jax_default_matmul_precision), *parts):
            h.update(str(p).encode())
            h.update(b"\0")
        return h.hexdigest()[:40]

    def load(self, key: str):
        """(the executable, None) or (None, why it missed: "off", "absent", "unusable: ...")."""
        if self.dir is None:
            return None, "off"
        path = self.dir / f"{key}.exe"
        if not path.is_file():
            return None, "absent"
        from jax.experimental import serialize_executable

        _link_mosaic_gpu_runtime()
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree), None
        except Exception as e:  # noqa: BLE001 - a stale or broken entry is a miss
            log.info("executable cache entry %s unusable (%s: %s): recompiling", path.name, type(e).__name__, e)
            return None, f"unusable: {type(e).__name__}: {str(e)[:300]}"

    def save(self, key: str, exe) -> str | None:
        """Write the entry; returns why it was not written (None when it was, or when off)."""
        if self.dir is None:
            return None
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(exe))
            tmp = self.dir / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_bytes(blob)
            os.replace(tmp, self.dir / f"{key}.exe")
        except Exception as e:  # noqa: BLE001 - e.g. executables with constants cannot be serialized
            log.info("executable %s not cached: %s: %s", key[:12], type(e).__name__, e)
            return f"{type(e).__name__}: {str(e)[:300]}"
        return None


def list_buckets(cfg: EngineConfig) -> list[StepBucket]:
    """Every bucket of a resolved config: decode N's, prefill T's, and mixed (N, T) pairs."""
    b = cfg.max_prefill_streams
    out = [StepBucket("decode", num_seqs=n) for n in cfg.decode_buckets]
    spec = cfg.speculative_config
    if spec is not None:  # a verify step per decode N (a step where no row drafts stays a decode step)
        out += [StepBucket("verify", num_seqs=n, num_spec=spec.num_speculative_tokens) for n in cfg.decode_buckets]
    out += [StepBucket("prefill", num_tokens=t, num_streams=b) for t in cfg.prefill_buckets]
    out += [StepBucket("mixed", num_seqs=n, num_tokens=t, num_streams=b)
            for n in cfg.mixed_decode_buckets for t in cfg.prefill_buckets]
    return out


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class CompilationManager:
    """Holds one executable per bucket of `cfg` (resolved) for `model`."""

    def __init__(self, model, cfg: EngineConfig, builder: BuilderConfig, placement=None, num_drafts: int = 0):
        self.model = model
        self.num_drafts = num_drafts  # k of an MTP drafter in every step (its decode steps are not split)
        self.cfg = cfg
        self.builder = builder
        self.placement = placement  # parallel.Placement under tensor parallelism, else None
        self.buckets = list_buckets(cfg)
        # R, next_tokens is i32[2R] (`step._next_tokens`): a verify step of N rows passes on one
        # token and one shift per row (N <= its decode bucket's), not its N x (1 + k) samples, so
        # it does not widen it, and the other steps compile as without speculation
        self.max_rows = max(b.num_sample_rows for b in self.buckets if b.kind != "verify")
        self.mask_words = -(-builder.vocab_size // 32)  # W of the structured-output bitmask i32[S, W]
        self._no_masks: dict[int, jax.Array] = {}  # S -> i32[S, W] of -1, on the device (sent once)
        self._flags: dict[bool, jax.Array] = {}  # the forward half's `sample` inputs, on the device
        self.executables: dict[StepBucket, jax.stages.Compiled] = {}
        self.swap_roles = None  # set by compile_all when cfg.preemption_mode == "swap"
        self.swap_executables: dict[tuple[str, int], jax.stages.Compiled] = {}  # ("gather"|"scatter", M)
        # ("forward" | "sample", decode bucket): a decode step is two executables, cut at the
        # logits, so that a step with structured-output rows dispatches its forward before the host
        # has filled their masks (engine._dispatch); the other steps run both halves back to back
        self.split_executables: dict[tuple[str, StepBucket], jax.stages.Compiled] = {}
        self.compile_seconds = 0.0
        self.warmup_seconds = 0.0
        self.cache_hits = 0  # executables loaded from the ExecutableCache at start-up
        self.cache_misses: dict[str, str] = {}  # str(bucket) -> why it was compiled ("absent", ...)
        self.cache_unsaved: dict[str, str] = {}  # str(bucket) -> why its executable was not cached
        self.temp_bytes = 0  # the largest executable's scratch memory
        self.exe_cache = ExecutableCache(executable_cache_dir())

    @property
    def compiler_options(self) -> dict | None:
        """XLA options of the step executables: conditionals inside the command buffers when the
        sampler skips under `lax.cond` on the GPU (`AttentionConfig.sampler_skip`); no
        rematerialization pass without `AttentionConfig.xla_remat`; programmatic dependent launch
        forced on or off by `AttentionConfig.xla_pdl` on the GPU; then `AttentionConfig.xla_options`."""
        opts = {}
        gpu = jax.default_backend() == "gpu"
        if self.cfg.attention.sampler_skip and gpu:
            opts["xla_gpu_enable_command_buffer"] = COMMAND_BUFFER_WITH_CONDITIONALS
        if self.cfg.attention.xla_pdl is not None and gpu:
            opts.update(dict.fromkeys(PDL_OPTIONS, self.cfg.attention.xla_pdl))
        if not self.cfg.attention.xla_remat:
            opts["xla_disable_hlo_passes"] = "rematerialization"
        opts.update(self.cfg.attention.xla_options)
        return opts or None

    def _static(self) -> dict:
        return dict(model=self.model, attn=self.cfg.attention, max_logprobs=self.cfg.max_logprobs,
                    placement=self.placement, num_drafts=self.num_drafts)

    def _input(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """A host input's abstract value: replicated on the mesh under tensor parallelism."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.placement.replicated if self.placement else None)

    def _step_args(self, bucket: StepBucket, params, state):
        """Abstract (params, state, ibuf, fbuf, prev_tokens, bitmask) of `bucket`'s step, and its
        static arguments."""
        layout = packed_layout(self.builder, bucket)
        args = (jax.tree.map(_abstract, params), jax.tree.map(_abstract, state),
                self._input((layout.num_i32,), jax.numpy.int32), self._input((layout.num_f32,), jax.numpy.float32),
                self._input((2 * self.max_rows,), jax.numpy.int32),
                self._input((bucket.num_sample_rows, self.mask_words), jax.numpy.int32))
        return args, dict(layout=layout, **self._static())

    def lower(self, bucket: StepBucket, params, state):
        args, static = self._step_args(bucket, params, state)
        return jit_packed_step(bucket.kind).lower(*args, **static)

    def lower_split(self, half: str, bucket: StepBucket, params, state):
        """Lower the "forward" or "sample" half of a decode or mixed bucket's step (`step.jit_packed_forward`
        / `jit_packed_sample`)."""
        (p, s, ibuf, fbuf, prev, mask), static = self._step_args(bucket, params, state)
        forward = jit_packed_forward(bucket.kind)
        flag = self._input((), jax.numpy.bool_)
        if half == "forward":
            return forward.lower(p, s, ibuf, fbuf, prev, mask, flag, **static)
        _, logits, plp, _, _ = jax.eval_shape(functools.partial(forward, **static), p, s, ibuf, fbuf, prev, mask, flag)
        logits, plp = jax.tree.map(lambda a: self._input(a.shape, a.dtype), (logits, plp))
        return jit_packed_sample(bucket.kind).lower(logits, s.penalties, ibuf, fbuf, plp, mask, prev, **static)

    def has_split(self, bucket: StepBucket) -> bool:
        return ("sample", bucket) in self.split_executables

    def executable_of(self, bucket: StepBucket) -> jax.stages.Compiled:
        """`bucket`'s executable (a split bucket's forward half: its HLO holds the model)."""
        return self.split_executables[("forward", bucket)] if self.has_split(bucket) else self.executables[bucket]

    @property
    def num_executables(self) -> int:
        """Step executables (a split bucket's two halves count as two)."""
        return len(self.executables) + len(self.split_executables)

    def run_forward(self, bucket: StepBucket, params, state, dev_inputs: tuple, prev_tokens):
        """The forward half of `bucket`'s step, its samples left to `run_sample`: (state, logits,
        prompt logprobs)."""
        state, logits, plp, _, _ = self.split_executables[("forward", bucket)](
            params, state, *dev_inputs, prev_tokens, self.no_mask(bucket.num_sample_rows), self._flag(False))
        return state, logits, plp

    def _flag(self, value: bool):
        """A bool[] input kept on the device (the forward half's `sample`)."""
        f = self._flags.get(value)
        if f is None:
            import numpy as np

            f = self._flags[value] = self.to_device(np.bool_(value))
        return f

    def run_sample(self, bucket: StepBucket, logits, penalties, dev_inputs: tuple, plp, bitmask, prev_tokens):
        """The sampling half: (SampleOutput, next_tokens), as `run` returns them."""
        if bitmask is None:
            bitmask = self.no_mask(bucket.num_sample_rows)
        return self.split_executables[("sample", bucket)](logits, penalties, *dev_inputs, plp, bitmask, prev_tokens)

    def lower_swap(self, kind: str, m: int, state):
        """Lower the swap `kind` ("gather" | "scatter") for block bucket `m`, or the SSM slot
        copy ("copy") of `m` pairs (prefix caching)."""
        from metrale_jax.engine.swap import jit_copy_slots, jit_gather, jit_scatter

        s = jax.tree.map(_abstract, state)
        blocks = self._input((m,), jax.numpy.int32)
        slot = self._input((), jax.numpy.int32)
        if kind == "copy":
            return jit_copy_slots().lower(s, blocks, blocks, roles=self.swap_roles, placement=self.placement)
        if kind == "gather":
            return jit_gather().lower(s, blocks, slot, roles=self.swap_roles, placement=self.placement)
        saved = jax.eval_shape(functools.partial(jit_gather(), roles=self.swap_roles), s, blocks, slot)
        saved = tuple(self._input(a.shape, a.dtype) for a in saved)
        return jit_scatter().lower(s, blocks, slot, saved, roles=self.swap_roles, placement=self.placement)

    def _key(self, bucket, params, state) -> str:
        """The ExecutableCache key of a step bucket or swap pair (no tracing)."""
        m = self.model
        # what the executables depend on: the static arguments (`_static`), the layout (builder +
        # bucket) and the argument shapes; not the other EngineConfig fields (seed, progress bars,
        # pool sizing knobs...), so that those do not cost a recompile
        return self.exe_cache.key(
            repr(m.cfg), getattr(m, "family_name", type(m).__name__), getattr(m, "dtype", ""),
            repr(self.cfg.attention), self.cfg.max_logprobs, self.num_drafts,
            repr(self.builder), repr(bucket), self.max_rows, _tree_signature(params), _tree_signature(state))

    def compile_all(self, params, state) -> float:
        """Load or compile every bucket (and swap pair); returns the wall time in seconds."""
        t0 = time.perf_counter()
        # decode and mixed steps (decode rows beside prompt chunks) in two halves, so that a step
        # with structured-output rows launches its forward before the host has their masks; with
        # `sample_in_forward` the forward half samples too, so the other steps launch once (an MTP
        # drafter needs the samples inside the step: none split)
        split = () if self.num_drafts else SPLIT_KINDS
        todo = [b for b in self.buckets if b.kind not in split and b not in self.executables]
        todo += [(half, b) for b in self.buckets if b.kind in split for half in ("forward", "sample")
                 if (half, b) not in self.split_executables]
        if self.cfg.swap_block_buckets:  # preemption by swap, or the prefix cache's host tier
            from metrale_jax.engine.swap import swap_roles

            self.swap_roles = swap_roles(self.model, state.model)
            todo += [(k, m) for m in self.cfg.swap_block_buckets for k in ("gather", "scatter")
                     if (k, m) not in self.swap_executables]
        if self.cfg.max_ssm_snapshots:  # prefix caching's SSM snapshot copies
            from metrale_jax.engine.swap import swap_roles

            self.swap_roles = self.swap_roles or swap_roles(self.model, state.model)
            if ("copy", self.num_copy_pairs) not in self.swap_executables:
                todo.append(("copy", self.num_copy_pairs))

        def one(bucket):
            key = self._key(bucket, params, state)
            exe, why = self.exe_cache.load(key)
            if exe is not None:
                return bucket, exe, True
            if why != "off":
                self.cache_misses[str(bucket)] = why
            if _is_split(bucket):
                exe = self.lower_split(*bucket, params, state).compile(compiler_options=self.compiler_options)
            elif isinstance(bucket, tuple):
                exe = self.lower_swap(*bucket, state).compile()
            else:
                exe = self.lower(bucket, params, state).compile(compiler_options=self.compiler_options)
            unsaved = self.exe_cache.save(key, exe)
            if unsaved:
                self.cache_unsaved[str(bucket)] = unsaved
            return bucket, exe, False

        workers = max(1, min(self.cfg.compile_workers or 1, len(todo)))
        bar = tqdm(total=len(todo), desc="compiling steps", unit="exe",
                   disable=None if self.cfg.show_progress else True)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for fut in concurrent.futures.as_completed([pool.submit(one, b) for b in todo]):
                bucket, exe, hit = fut.result()
                self.cache_hits += hit
                if isinstance(bucket, tuple) and not _is_split(bucket):
                    self.swap_executables[bucket] = exe
                    bar.update(1)
                    continue
                if _is_split(bucket):
                    self.split_executables[bucket] = exe
                else:
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
        log.info("%d step executables ready in %.1fs (%d from the executable cache; largest scratch %.1f MB)",
                 len(todo), self.compile_seconds, self.cache_hits, self.temp_bytes / 1e6)
        return self.compile_seconds

    def warm_up(self, params, state):
        """Run every step executable once on padding inputs (they write nothing; the state is
        donated and returned). Returns the state."""
        t0 = time.perf_counter()
        prev = self.zero_tokens()
        for bucket in self.buckets:
            dev = self.transfer(build_step(self.builder, bucket, [], []))
            state, out, prev = self.run(bucket, params, state, dev, prev)
            if self.has_split(bucket) and self.cfg.attention.sample_in_forward:  # (the two-launch form too)
                state, logits, plp = self.run_forward(bucket, params, state, dev, prev)
                out, prev = self.run_sample(bucket, logits, state.penalties, dev, plp, None, prev)
        jax.block_until_ready((state, prev))
        self.warmup_seconds = time.perf_counter() - t0
        log.info("ran each of the %d steps once in %.2fs", len(self.buckets), self.warmup_seconds)
        return state

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

    def run(self, bucket: StepBucket, params, state, dev_inputs: tuple, prev_tokens=None, bitmask=None):
        """Run the executable of `bucket` on its packed inputs (i32 buffer, f32 buffer, as `put` gives them),
        the previous step's `next_tokens` (zeros when None) and the structured-output `bitmask`
        i32[bucket.num_sample_rows, mask_words] (None: no row constrained, a constant of -1 kept
        on the device, so nothing is sent). Returns (state, out, next_tokens). A split bucket (SPLIT_KINDS) runs
        its forward half, which samples too under `AttentionConfig.sample_in_forward` (one launch),
        else its two halves."""
        split = self.has_split(bucket)
        exe = self.split_executables[("forward", bucket)] if split else self.executables.get(bucket)
        if exe is None:
            raise RuntimeError(f"step bucket {bucket} was not compiled at start-up (a bug)")
        if prev_tokens is None:
            prev_tokens = self.zero_tokens()
        if bitmask is None:
            bitmask = self.no_mask(bucket.num_sample_rows)
        if split and self.cfg.attention.sample_in_forward:  # (one launch)
            state, _, _, out, nxt = exe(params, state, *dev_inputs, prev_tokens, bitmask, self._flag(True))
            return state, out, nxt
        if split:
            state, logits, plp = self.run_forward(bucket, params, state, dev_inputs, prev_tokens)
            out, nxt = self.run_sample(bucket, logits, state.penalties, dev_inputs, plp, bitmask, prev_tokens)
            return state, out, nxt
        return exe(params, state, *dev_inputs, prev_tokens, bitmask)

    def no_mask(self, rows: int):
        """The all-allowed bitmask i32[rows, mask_words] (-1), made on the device once per size."""
        m = self._no_masks.get(rows)
        if m is None:
            import numpy as np

            m = self._no_masks[rows] = self.to_device(np.full((rows, self.mask_words), -1, np.int32))
        return m

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
            local(a).copy_to_host_async()
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

    @property
    def num_copy_pairs(self) -> int:
        """Slot pairs per SSM copy call: a step's decode rows plus its prefill streams."""
        return self.cfg.max_num_seqs + self.cfg.max_prefill_streams

    def copy_ssm_slots(self, state, pairs: list[tuple[int, int]]):
        """Copy SSM slot rows (source, destination) of `state` (donated), in calls of
        `num_copy_pairs` pairs; returns the new state."""
        import numpy as np

        k = self.num_copy_pairs
        exe = self.swap_executables[("copy", k)]
        for i in range(0, len(pairs), k):
            part = pairs[i:i + k]
            src = np.zeros(k, np.int32)
            dst = np.full(k, -1, np.int32)
            src[: len(part)] = [p[0] for p in part]
            dst[: len(part)] = [p[1] for p in part]
            state = exe(state, src, dst)
        return state

    def zero_tokens(self):
        import numpy as np

        return self.to_device(np.zeros(2 * self.max_rows, np.int32))

    def _device(self):
        return self.placement.replicated if self.placement else None

    def transfer(self, inputs: StepInputs) -> tuple:
        """Pack a step's inputs and send them to the device (every device of the mesh under tensor
        parallelism) in one transfer."""
        _, ibuf, fbuf = pack(self.builder, inputs)
        return self.put(ibuf, fbuf)

    def put(self, *host):
        """Host step inputs (the packed metadata of `metadata_builder.pack`, a bitmask) for the
        device (every device of the mesh under tensor parallelism): one array or a tuple.

        On one device they stay numpy arrays: the executable's call copies them in from C++ (a
        small copy each, even when both halves of a split step take them), where `jax.device_put`
        took 0.55-0.58 ms a step under cProfile (H100, session 49: a one-row int4 step's host work
        was as long as its 2.6 ms device step, so the host set the pace)."""
        if self._device() is None:
            return host if len(host) > 1 else host[0]
        return self.to_device(*host)

    def to_device(self, *host):
        """Host arrays to device arrays (every device of the mesh under tensor parallelism)."""
        sharding = self._device()
        if sharding is None or sharding.is_fully_addressable:
            return jax.device_put(host if len(host) > 1 else host[0], sharding)
        # several processes: each puts its own copy on its devices (`jax.device_put` would first
        # check, with a collective, that every process passed the same data)
        out = tuple(jax.make_array_from_callback(np.shape(h), sharding, lambda idx, h=h: np.asarray(h)[idx])
                    for h in host)
        return out if len(out) > 1 else out[0]


SPLIT_KINDS = ("decode", "mixed")  # the step kinds compiled as a forward half and a sample half


def _is_split(key) -> bool:
    """A compile_all work item for a half of a split step: ("forward" | "sample", bucket)."""
    return isinstance(key, tuple) and isinstance(key[1], StepBucket)


def _ceil_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
