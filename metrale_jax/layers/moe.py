"""Sparse mixture-of-experts MLP: routers and the routed experts as a grouped GEMM.

The routed experts run as a grouped GEMM over the (token, expert) pairs sorted by expert:
`jax.lax.ragged_dot` (pure XLA, the CPU path), or on the GPU tokamax's `ragged_dot` (a Mosaic
GPU kernel). Measured on the H200 (bench/results/grouped_matmul_2026-11-29.md) tokamax ran
121-178 us where XLA's ragged_dot took 330-2425 us, and beat our own Pallas kernel (removed).

tokamax, how we call it (read from the tokamax 0.0.17 source, the GPU machine's version):
* Availability is decided once per process by importing tokamax for real and reading
  `tokamax.ragged_dot` and its Mosaic GPU op (`tokamax._src.ops.ragged_dot.pallas_mosaic_gpu`,
  the module that `tokamax.ops.gpu` re-exports; that public module also imports triton and
  jax_triton, which the Mosaic path does not need). `find_spec` alone said yes when tokamax's
  dependency pydantic was missing, and the step then failed. On any failure the experts run
  through `jax.lax.ragged_dot`, with one warning that gives the error.
* Config choice inside tokamax: `Op.__call__` asks `BoundArguments.default_config`, which returns
  `op.config` when set; otherwise it looks the shape up in the autotuning cache shipped in the
  wheel (`tokamax/data/autotuning/<device kind>/...json`: A100, B200 and TPUs, no H200 file),
  logs `Autotuning cache miss for <op> on <device> with key <json>` through absl at WARNING for
  every traced call that misses, and then falls back as the absl flag
  `--tokamax_autotuning_cache_miss_fallback` says: "heuristics" (the default: the op's
  `_get_heuristics_config`), "autotune" (benchmark every candidate config, at trace time) or
  "error". The context manager `tokamax.config.autotuning_cache_miss_fallback(...)` sets the
  same per scope. So with default flags 0.0.17 does not autotune on a miss: the hundreds of
  warning lines on the H200 were the cache misses, one per MoE GEMM per traced step, each
  followed by the heuristic config (the same config `tokamax_op` now passes).
* What we do: resolve tokamax's own heuristic config at trace time
  (`op.bind(x, w, group_sizes=..., preferred_element_type=f32).heuristics_config`: on Hopper
  bf16 block 64x64x128, 2 stages, not persistent, M-minor grid; other chips get their own) and
  pass it explicitly (`op.replace(config=cfg)` as the `implementation`), so neither the cache
  lookup, nor its warning, nor autotuning can happen, whatever the flags say. The H200 bench
  found that heuristic within 7% of the best of four other configs on every case (one prefill
  shape ran 6% faster at 64x128x64/6 stages, but slower on both decode shapes), so no tuned
  table ships.
* Start-up: the tokamax call is a jitted function of its own (`_tokamax_grouped_matmul`), so a
  step lowers and compiles the kernel once per shape, not once per MoE layer: inlined, 16 layers
  took 31 s to lower and compile on the H200 (1.9 s per layer: the cause of the slow Qwen3-Next
  start-up, not autotuning), 2.9 s this way.
* Logs: a filter on absl's logger lets each distinct tokamax message template through once at
  WARNING or below and drops the repeats (errors and other libraries' absl records pass).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from metrale_jax.layers.mlp import linear

log = logging.getLogger(__name__)


def softmax_topk_router(x, w_router, top_k: int, norm_topk_prob: bool):
    """Qwen-style router. x [T, H], w_router [H, E] -> (weights f32[T, k], experts i32[T, k])."""
    logits = linear(x, w_router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype).astype(jnp.float32), idx.astype(jnp.int32)


class _Tokamax(NamedTuple):
    ragged_dot: Any  # tokamax.ragged_dot
    op: Any  # a PallasMosaicGpuRaggedDot without config: `op.bind(...)`, `op.replace(config=...)`


class _TokamaxLogFilter(logging.Filter):
    """On absl's logger: a record at WARNING or below logged from tokamax's source passes the
    first time its message template is seen; repeats are dropped. Errors and the absl records of
    other libraries (orbax, ...) pass untouched."""

    def __init__(self, source_dir: str):
        super().__init__()
        self.source_dir = source_dir
        self.seen: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not record.pathname.startswith(self.source_dir):
            return True
        key = (record.levelno, str(record.msg))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _install_log_filter(source_dir: str) -> None:
    absl_log = logging.getLogger("absl")
    for f in [f for f in absl_log.filters if isinstance(f, _TokamaxLogFilter)]:
        absl_log.removeFilter(f)
    absl_log.addFilter(_TokamaxLogFilter(source_dir))


@functools.cache
def _load_tokamax() -> _Tokamax | None:
    """tokamax's ragged_dot and Mosaic GPU op, imported for real once per process; None (after
    one warning that says why) when tokamax is missing or broken."""
    try:
        import tokamax

        ragged_dot = tokamax.ragged_dot  # first: a half-imported tokamax fails here, and says so
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu

        found = _Tokamax(ragged_dot, pallas_mosaic_gpu.PallasMosaicGpuRaggedDot())
    except Exception as e:  # ImportError of a dependency, an AttributeError, a flag clash: all mean "unusable"
        log.warning("tokamax unavailable (%s: %s): MoE experts run through jax.lax.ragged_dot (slower on the GPU)",
                    type(e).__name__, e)
        return None
    _install_log_filter(os.path.dirname(os.path.abspath(tokamax.__file__)) + os.sep)
    return found


def tokamax_available() -> bool:
    """Whether tokamax imports and has `ragged_dot` (decided once; see the module docstring)."""
    return _load_tokamax() is not None


def tokamax_op(tk: _Tokamax, x, w, sizes, preferred_element_type=jnp.float32):
    """tokamax's Mosaic GPU op with its own heuristic config for these shapes bound in (no cache
    lookup, no autotuning). x [M, K], w [G, K, N] (an array or a qwix `QArray`), sizes i32[G];
    abstract values suffice."""
    cfg = tk.op.bind(x, w, group_sizes=sizes, preferred_element_type=preferred_element_type).heuristics_config
    return tk.op.replace(config=cfg)


@jax.jit
def _tokamax_grouped_matmul(x, w, sizes):
    """tokamax's grouped GEMM, x [M, K], w [G, K, N], sizes i32[G] -> f32[M, N].

    A jitted function of its own: every MoE layer of a step calls this one function, so JAX
    lowers it (and the Mosaic GPU kernel with it) once per shape and the step's HLO calls it,
    where inlined each call site carried its own copy of the kernel. On the H200, 16 MoE layers
    (Qwen3-Next shape, 64 tokens) took 8.4 s to lower and 22.5 s to compile inlined, 0.5 s and
    2.4 s this way (XLA's ragged_dot: 0.1 s and 4.9 s)."""
    tk = _load_tokamax()
    m = x.shape[0]
    x, sizes = pad_rows_for_tma(x, sizes)
    op = tokamax_op(tk, x, w, sizes)
    y = tk.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32, implementation=(op,))  # f32[M + pad, N]
    return y[:m]


def pad_rows_for_tma(x, sizes):
    """x [M, K], sizes i32[G] -> the same padded for tokamax's TMA tiling, which takes M <= 8 or a
    multiple of 8 rows (M = 10 for one token routed to 10 experts failed on the H200): rows of the
    last group added, to be dropped from the output."""
    m = x.shape[0]
    pad = -m % 8 if m > 8 else 0
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))  # [M + pad, K]
        sizes = sizes.at[-1].add(pad)
    return x, sizes


def grouped_matmul(x, w, sizes, use_tokamax: bool):
    """x [M, K] rows sorted by group, w [G, K, N], sizes i32[G] (summing to M) -> f32[M, N].

    use_tokamax: tokamax's Mosaic GPU kernel for bf16/f16 operands (it takes no others: a float32
    model raised NotImplementedError on the H200); falls back to `jax.lax.ragged_dot` for other
    dtypes and when tokamax is unusable (one warning per process)."""
    # (tokamax's TMA tiles take K below 64 or a multiple of it: K = 96 failed to lower on the H100)
    k = x.shape[-1]
    if use_tokamax and x.dtype in (jnp.bfloat16, jnp.float16) and (k < 64 or k % 64 == 0) and tokamax_available():
        return _tokamax_grouped_matmul(x, w, sizes)
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def routed_experts(x, weights, experts, w_gate_up, w_down, act=jax.nn.silu, gated: bool = True,
                   use_tokamax: bool = False, lora=None):
    """Run each token through its k experts and sum the weighted outputs.

    x [T, H], weights f32[T, k], experts i32[T, k], w_gate_up [E, H, 2I] (gated) or [E, H, I],
    w_down [E, I, H] -> [T, H] in x's dtype. use_tokamax: the GPU grouped GEMM (see module doc).
    lora: a `metrale_jax.lora.ops.LoRAInputs` with expert leaves: the gate/up/down LoRA deltas of
    the tokens whose `moe_slot` >= 0 (gated experts only).
    Quantized experts (block-FP8 `Fp8Linear`s [E, N_pad, K], 4-bit `W4Linear`s [E, N, K/2]): few
    pairs through `pair_experts` with their format's `pair_matvec` (`moe_fp8`, `moe_w4`), the others
    through the grouped GEMM below with the format's (`moe_fp8.fp8_grouped_matmul`,
    `moe_w4.w4_grouped_matmul`).
    """
    from metrale_jax.layers.linear import Fp8Linear, W4Linear

    if isinstance(w_gate_up, (Fp8Linear, W4Linear)):
        from metrale_jax.layers import moe_fp8, moe_w4

        fp8 = isinstance(w_gate_up, Fp8Linear)
        quant = moe_fp8 if fp8 else moe_w4
        if lora is not None and "x_down_b" in lora.w:
            raise ValueError("LoRA on quantized (FP8 or 4-bit) MoE experts is not supported: build the engine "
                             "with lora_experts=False")
        if quant.use_pairs(x, experts, w_down):
            return pair_experts(x, weights, experts, w_gate_up, w_down, quant.pair_matvec, act=act, gated=gated)
        matmul = functools.partial(moe_fp8.fp8_grouped_matmul if fp8 else moe_w4.w4_grouped_matmul,
                                   use_tokamax=use_tokamax)
    else:
        def matmul(xs, w, sizes):
            return grouped_matmul(xs, w.astype(xs.dtype), sizes, use_tokamax)
    t, k = experts.shape
    num_experts = num_experts_of(w_down)
    flat = experts.reshape(-1)  # i32[T*k]
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    tok = order // k  # i32[T*k]: the token of each sorted pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # i32[E]
    xs = x[tok]
    h = matmul(xs, w_gate_up, sizes)
    if lora is not None and "x_down_b" not in lora.w:
        lora = None  # an engine without expert LoRA slots (EngineConfig.lora_experts=False)
    if lora is not None:
        from metrale_jax.lora.ops import expert_groups, expert_lora

        lw = lora.w
        grp = expert_groups(lora.moe_slot, flat, order, k, num_experts, lw["x_down_b"].shape[0])
        h = h + expert_lora(xs, grp, lw["x_gate_up_a"], lw["x_gate_up_b"], use_tokamax)
    a = _activation(h, act, gated)
    y = matmul(a.astype(x.dtype), w_down, sizes)
    if lora is not None:
        y = y + expert_lora(a.astype(x.dtype), grp, lw["x_down_a"], lw["x_down_b"], use_tokamax)
    y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[tok].add(y).astype(x.dtype)


def num_experts_of(w) -> int:
    """E of one layer's experts: an array [E, ...], an `Fp8Linear` or a `W4Linear`."""
    return getattr(w, "w8", getattr(w, "packed", w)).shape[0]


def pair_experts(x, weights, experts, w_gate_up, w_down, matvec, act=jax.nn.silu, gated: bool = True):
    """As `routed_experts` (x [T, H], weights f32[T, k], experts i32[T, k] -> [T, H]), each (token,
    expert) pair through its expert's weights alone: matvec(xp [P, K], w, flat i32[P]) -> f32[P, N]
    (a quantized format's `pair_matvec`). For decode, where the P = T * k pairs route to fewer
    experts than the layer has, so reading each pair's expert beats a grouped GEMM over all."""
    t, k = experts.shape
    flat = experts.reshape(-1)  # i32[P]
    xs = jnp.repeat(x, k, axis=0)  # [P, H]: pair p = (token p // k, its (p % k)-th expert)
    a = _activation(matvec(xs, w_gate_up, flat), act, gated)
    y = matvec(a.astype(x.dtype), w_down, flat)
    y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[:, None]
    return y.reshape(t, k, -1).sum(axis=1).astype(x.dtype)


def _activation(h, act, gated: bool):
    """The experts' hidden activation: act(gate) * up of h = gate | up (gated), else act(h)."""
    if gated:
        g, u = jnp.split(h, 2, axis=-1)
        return act(g) * u
    return act(h)
