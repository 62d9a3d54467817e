"""4-bit weight-streaming kernel benchmark (GPU machine): Llama-3-8B projections at decode sizes.

For each projection (K -> N), M in {1, 8, 16, 32, 64} and both 4-bit kinds (int4: group 128,
float16 scales, uint8 zeros, the GPTQ / AWQ / W4A16 layout after `quant/w4.py`; fp4: NVFP4, e4m3
scales per 16, a per-row global scale), it times on weights rotating through distinct copies of
>= 256 MB (over 4x the H200's 60 MB L2, so HBM is timed):
* `skinny_matmul_w4` (pallas_kernels/linear/w4.py) over a small sweep of `W4Params`;
* the prefill path: XLA dequantize-then-dot on the same packed weights;
* `xla_native_4bit`: the same weights as XLA's int4 / float4_e2m1fn arrays, dequantized by
  element-wise ops on the dot's operand (whether XLA fuses that into its GEMM at decode sizes
  decides whether a Pallas kernel is needed at all; added in session 23, not yet run on the GPU);
* XLA's bf16 dot with W [N, K] (what a bf16 checkpoint runs), the baseline;
next to a torch `copy_` of 2 GiB (read + write bytes) measured in the same run (the ceiling).
Reported: packed weight bytes / time (the issue's bar: >= 3.4 TB/s at M = 1, goal 3.8), all
bytes (with scales and zeros) / time, and the speed-up over bf16. Each kernel's output on copy 0
is checked against a float32 dot on the dequantized weight.

Run (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/kernels/w4.py --out DIR           # DIR/w4.json, w4.md, tuned_w4.json
    PYTHONPATH=. python3 bench/kernels/w4.py --out DIR --cpu-smoke   # tiny shapes, interpret mode
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.linear import W4Params, dequantize_w4_reference, skinny_matmul_w4  # noqa: E402
from pallas_kernels.linear.w4 import w4_params_for, w4_tuned_key  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
MS = (1, 8, 16, 32, 64)
KINDS = {"int4": 128, "fp4": 16}  # kind: group size
SWEEP = [W4Params(16, 512, 4, 4), W4Params(32, 512, 4, 4), W4Params(32, 1024, 4, 3), W4Params(64, 512, 4, 3),
         W4Params(64, 256, 8, 4), W4Params(128, 256, 8, 3),
         # int4 only (NVFP4's groups of 16 are too narrow): per-group dots of raw codes, scale on the partial
         W4Params(16, 512, 4, 4, True), W4Params(32, 256, 4, 4, True), W4Params(64, 256, 4, 3, True),
         W4Params(128, 128, 8, 3, True),
         # M = 1 on the CUDA cores (the dot for other M)
         W4Params(16, 1024, 4, 4, gemv=True), W4Params(32, 512, 4, 4, gemv=True), W4Params(16, 2048, 4, 3, gemv=True),
         # scale / zero tiles broadcast in registers instead of one gathered scale per byte
         W4Params(32, 512, 4, 4, scale_tile=True), W4Params(64, 256, 4, 3, scale_tile=True),
         W4Params(16, 1024, 4, 4, gemv=True, scale_tile=True),
         # M = 1, per-group partial sums without conversions (session 23; int4 and NVFP4)
         W4Params(16, 1024, 4, 4, True, True), W4Params(32, 512, 4, 4, True, True),
         W4Params(64, 512, 8, 3, True, True), W4Params(64, 1024, 8, 3, True, True),
         W4Params(128, 256, 8, 3, True, True), W4Params(32, 2048, 8, 2, True, True),
         # the same with the K loop unrolled (every weight load of a program visible at once)
         W4Params(16, 1024, 4, 1, True, True, unroll=True), W4Params(32, 512, 4, 1, True, True, unroll=True),
         W4Params(16, 512, 4, 1, True, True, unroll=True), W4Params(32, 1024, 8, 1, True, True, unroll=True),
         W4Params(16, 1024, 4, 1, gemv=True, scale_tile=True, unroll=True),
         W4Params(32, 512, 4, 1, scale_tile=True, unroll=True),
         # M = 1: u32 words, 8 codes summed per inline-PTX call in half2 (session 25; the int4 winners of its
         # sweep, with and without unroll / prefetch)
         W4Params(16, 1024, 4, 4, True, True, half2=True), W4Params(16, 2048, 4, 3, True, True, half2=True),
         W4Params(32, 2048, 4, 3, True, True, half2=True),
         W4Params(16, 2048, 4, 1, True, True, unroll=True, half2=True),
         W4Params(32, 1024, 4, 1, True, True, unroll=True, half2=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True),
         # the same split along K (f32 partials added by XLA)
         W4Params(16, 1024, 4, 3, True, True, half2=True, split_k=2), W4Params(16, 1024, 4, 3, True, True, half2=True,
                                                                                split_k=4),
         W4Params(16, 2048, 4, 3, True, True, half2=True, split_k=2),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=2),
         # each word times its own group's scale (session 29; for NVFP4's groups of 16): the winners above
         W4Params(16, 1024, 4, 4, True, True, half2=True, word_scales=True),
         W4Params(16, 2048, 4, 3, True, True, half2=True, word_scales=True),
         W4Params(16, 2048, 4, 1, True, True, unroll=True, half2=True, word_scales=True),
         W4Params(32, 1024, 4, 1, True, True, unroll=True, half2=True, word_scales=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, word_scales=True),
         W4Params(16, 1024, 4, 3, True, True, half2=True, split_k=2, word_scales=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=2, word_scales=True),
         W4Params(32, 1024, 4, 1, True, True, half2=True, prefetch=True, word_scales=True),
         # ... and int4's own M = 1 winners (q/k/v, down) with word scales (session 30)
         W4Params(32, 2048, 4, 3, True, True, half2=True, word_scales=True),
         W4Params(16, 2048, 4, 3, True, True, half2=True, split_k=2, word_scales=True),
         # the narrow projections (q/k/v, o, down) split further along K, shorter steps, 8 warps (session 31)
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=3, word_scales=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=4, word_scales=True),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=True, split_k=2, word_scales=True),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=True, split_k=4, word_scales=True),
         W4Params(16, 1024, 4, 3, True, True, half2=True, split_k=3, word_scales=True),
         W4Params(16, 2048, 8, 3, True, True, half2=True, split_k=2, word_scales=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=3),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=4),
         W4Params(16, 2048, 4, 3, True, True, half2=True, split_k=3),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=True, split_k=4),
         W4Params(16, 2048, 8, 3, True, True, half2=True, split_k=2),
         # the dot path transposed (session 36): the dequantized weight tile as the dot's first operand
         W4Params(64, 256, 4, 3, swap_ab=True),
         # M = 1: x's pairs packed once per word column (session 36), beside each shape's tuned table pick
         W4Params(32, 2048, 4, 3, True, True, half2=True, packed_x=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, packed_x=True),
         W4Params(32, 1024, 4, 1, True, True, unroll=True, half2=True, packed_x=True),
         W4Params(16, 2048, 4, 3, True, True, half2=True, split_k=2, packed_x=True),
         W4Params(16, 2048, 4, 1, True, True, unroll=True, half2=True, packed_x=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=2, word_scales=True, packed_x=True),
         W4Params(16, 2048, 4, 3, True, True, half2=True, word_scales=True, packed_x=True),
         W4Params(16, 1024, 4, 3, True, True, half2=True, split_k=2, word_scales=True, packed_x=True),
         # M = 1, whole-K tiles (session 39): block_k 4,096 is a q/k/v, o or gate|up row's whole K in one step,
         # so a program issues all its loads at once (32 KB at block_n 16: the narrow projections ran at 1.1-1.5
         # TB/s with one 8-16 KB step in flight per program); down (K 14,336) in 4 steps, or one per split
         W4Params(16, 4096, 4, 1, True, True, half2=True), W4Params(16, 4096, 8, 1, True, True, half2=True),
         W4Params(32, 4096, 8, 1, True, True, half2=True),
         W4Params(16, 4096, 4, 1, True, True, half2=True, word_scales=True),
         W4Params(16, 4096, 8, 1, True, True, half2=True, word_scales=True),
         W4Params(16, 4096, 4, 1, True, True, half2=True, packed_x=True),
         W4Params(16, 4096, 4, 1, True, True, half2=True, split_k=2),
         W4Params(16, 4096, 4, 1, True, True, half2=True, split_k=4),
         W4Params(16, 4096, 4, 1, True, True, half2=True, split_k=4, word_scales=True),
         # more warps a program, fewer words a thread (session 46: Nsight Compute on the H100 found the one-row
         # programs at 1.5-4.4 active warps a scheduler, 79-167 registers a thread, latency-bound):
         # `--only half2,num_warps`
         W4Params(16, 2048, 8, 1, True, True, half2=True), W4Params(16, 2048, 16, 1, True, True, half2=True),
         W4Params(32, 2048, 8, 1, True, True, half2=True), W4Params(32, 2048, 16, 1, True, True, half2=True),
         W4Params(16, 4096, 16, 1, True, True, half2=True), W4Params(32, 4096, 16, 1, True, True, half2=True),
         W4Params(64, 2048, 16, 1, True, True, half2=True), W4Params(32, 1024, 8, 1, True, True, half2=True),
         W4Params(16, 2048, 16, 1, True, True, half2=True, split_k=2),
         # the next step's tile in flight while this one computes, at more steps and programs (for the Nsight
         # Compute sweep, session 46: the shipped picks load a step, then compute it): `--only half2,prefetch`
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=True),
         W4Params(32, 512, 4, 1, True, True, half2=True, prefetch=True),
         W4Params(16, 512, 8, 1, True, True, half2=True, prefetch=True),
         W4Params(16, 1024, 8, 1, True, True, half2=True, prefetch=True),
         W4Params(32, 1024, 4, 1, True, True, half2=True, prefetch=True),
         W4Params(16, 2048, 4, 1, True, True, half2=True, prefetch=True),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=True, split_k=2),
         # and 2-4 steps ahead (a ring of loads in flight; one step ahead cannot cover a load's latency when
         # a step's math is shorter)
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=2),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=3),
         W4Params(16, 256, 4, 1, True, True, half2=True, prefetch=4),
         W4Params(32, 512, 4, 1, True, True, half2=True, prefetch=2),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=2),
         W4Params(16, 512, 8, 1, True, True, half2=True, prefetch=3),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=2, split_k=2),
         W4Params(16, 512, 4, 1, True, True, unroll=True, half2=True, prefetch=2),  # (the ring without moves)
         W4Params(16, 1024, 4, 1, True, True, unroll=True, half2=True, prefetch=2),
         # around session 47's Nsight Compute winners (q|k|v, o: the unrolled ring of 2 at block_n 16;
         # gate|up: block_k 2048 unrolled with packed x; down: split in 2): shorter and deeper rings,
         # 2 and 8 warps, 32 rows, packed x and word scales on the ring, the ring split along K
         W4Params(16, 256, 4, 1, True, True, unroll=True, half2=True, prefetch=2),
         W4Params(16, 512, 4, 1, True, True, unroll=True, half2=True, prefetch=3),
         W4Params(16, 512, 2, 1, True, True, unroll=True, half2=True, prefetch=2),
         W4Params(16, 512, 8, 1, True, True, unroll=True, half2=True, prefetch=2),
         W4Params(32, 512, 4, 1, True, True, unroll=True, half2=True, prefetch=2),
         W4Params(16, 512, 4, 1, True, True, unroll=True, half2=True, prefetch=2, packed_x=True),
         W4Params(16, 512, 4, 1, True, True, unroll=True, half2=True, prefetch=2, word_scales=True),
         W4Params(16, 1024, 4, 1, True, True, unroll=True, half2=True, prefetch=2, packed_x=True),
         W4Params(16, 1024, 4, 1, True, True, unroll=True, half2=True, prefetch=2, split_k=2),
         W4Params(16, 2048, 4, 1, True, True, unroll=True, half2=True, prefetch=1, packed_x=True),
         W4Params(16, 2048, 4, 1, True, True, unroll=True, half2=True, split_k=2, packed_x=True),
         # the scales and zeros carried by the ring too (`ring_scales`, session 47): `--only half2,ring_scales`
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=2, ring_scales=True),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=3, ring_scales=True),
         W4Params(16, 512, 4, 1, True, True, unroll=True, half2=True, prefetch=2, ring_scales=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=2, split_k=2, ring_scales=True),
         W4Params(16, 1024, 4, 1, True, True, half2=True, prefetch=True, split_k=2, word_scales=True,
                  ring_scales=True),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=True, split_k=4, word_scales=True,
                  ring_scales=True),
         W4Params(16, 512, 4, 1, True, True, half2=True, prefetch=2, split_k=4, word_scales=True,
                  ring_scales=True),
         # around session 48's NVFP4 winner for q|k|v and o (8 warps, the unrolled ring of 2 at block_n 16: 49
         # registers against 72-133 at 4 warps, w4_ptxas.py): 8 and 16 warps with the other winners' choices
         W4Params(16, 1024, 8, 1, True, True, unroll=True, half2=True, prefetch=2),
         W4Params(16, 1024, 8, 1, True, True, unroll=True, half2=True, prefetch=2, packed_x=True),
         W4Params(16, 512, 8, 1, True, True, unroll=True, half2=True, prefetch=2, packed_x=True),
         W4Params(16, 512, 8, 1, True, True, unroll=True, half2=True, prefetch=2, ring_scales=True),
         W4Params(16, 512, 8, 1, True, True, unroll=True, half2=True, prefetch=2, word_scales=True),
         W4Params(16, 256, 8, 1, True, True, unroll=True, half2=True, prefetch=3),
         W4Params(16, 512, 16, 1, True, True, unroll=True, half2=True, prefetch=2),
         W4Params(16, 2048, 8, 1, True, True, unroll=True, half2=True, packed_x=True),
         W4Params(16, 2048, 8, 1, True, True, unroll=True, half2=True, prefetch=1, packed_x=True),
         W4Params(16, 512, 8, 1, True, True, unroll=True, half2=True, prefetch=2, split_k=2),
         W4Params(16, 512, 8, 1, True, True, half2=True, prefetch=True, split_k=4, word_scales=True),
         # (session 46 also measured one group a step, block_k 128 unrolled: 2-3.5x slower at 40 registers and
         # 9% occupancy; and x read as eight column vectors instead of a [W, 8] load split through shared
         # memory: q|k|v 11.2 against 11.0 us under Nsight Compute, its smem stalls became HBM waits. Neither kept.)
         ] + [
             W4Params(bn, bk, nw, ns, scale_tile=True, swap_ab=True)
             for bn, bk, nw, ns in [(64, 256, 4, 3), (64, 512, 4, 3), (128, 256, 8, 3), (128, 128, 8, 4),
                                    (64, 128, 4, 4), (128, 256, 4, 3), (64, 256, 8, 3)]]
MIN_ROTATION_BYTES = 256e6


def sweep_with(fields: str) -> list[W4Params]:
    """The SWEEP entries with each of `fields` (comma-separated W4Params names) changed from its default."""
    return [p for p in SWEEP if all(getattr(p, f) != getattr(W4Params(), f) for f in filter(None, fields.split(",")))]


def _memcpy() -> float:
    """torch copy_ bandwidth (bytes/s): bench/kernels/linear.py's measurement."""
    import sys

    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from linear import _memcpy as memcpy

    return memcpy(torch)


def _weights(key, n, k, kind, group, copies):
    """copies x (packed u8[N, K/2], scales [N, K/G], aux) on the device."""
    out = []
    ng = -(-k // group)
    for i in range(copies):
        kk = jax.random.fold_in(key, i)
        packed = jax.random.randint(kk, (n, (k + 1) // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        if kind == "int4":
            scales = jax.random.uniform(jax.random.fold_in(kk, 1), (n, ng), jnp.float32, 1e-3, 4e-3).astype(jnp.float16)
            aux = jax.random.randint(jax.random.fold_in(kk, 2), (n, ng), 6, 10, jnp.int32).astype(jnp.uint8)
        else:
            scales = jax.random.uniform(jax.random.fold_in(kk, 1), (n, ng), jnp.float32, 0.5, 4).astype(
                jnp.float8_e4m3fn)
            aux = jnp.full((n,), 1e-3, jnp.float32)
        out.append((packed, scales, aux))
    jax.block_until_ready(out)
    return out


def _dequant_dot(x, packed, scales, aux, *, k, group_size, kind):
    """The prefill path: the whole weight dequantized to bf16, then one dot."""
    w = dequantize_w4_reference(packed, scales, aux, k=k, group_size=group_size, kind=kind).astype(jnp.bfloat16)
    return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _xla_native(ws, kind, k, group):
    """The copies as XLA's own 4-bit types ("xla_native": int4 codes - 8 with zeros - 8, or
    float4_e2m1fn values), [N, K] with scales [N, K/G] (and zeros / row scales): what a weight-only
    path through XLA's fused dot would store (XLA packs 4-bit arrays two to a byte on the GPU)."""
    out = []
    for packed, scales, aux in ws:
        codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)[:, :k]
        if kind == "int4":
            w = (codes.astype(jnp.int8) - 8).astype(jnp.int4)
            out.append((w, scales, (aux.astype(jnp.int8) - 8)))
        else:
            w = dequantize_w4_reference(packed, jnp.ones_like(scales, jnp.float32), jnp.ones_like(aux), k=k,
                                        group_size=group, kind=kind).astype(jnp.float4_e2m1fn)
            out.append((w, scales, aux))
    jax.block_until_ready(out)
    return out


def _xla_native_dot(x, w, scales, aux, *, kind, group_size):
    """XLA's dot over the dequantized 4-bit weight, the dequantization written as element-wise ops
    on the dot's operand (XLA may fuse it into its GEMM, or materialize the bf16 weight)."""
    n, k = w.shape
    wg = w.astype(jnp.bfloat16).reshape(n, k // group_size, group_size)
    if kind == "int4":
        wg = wg - aux.astype(jnp.bfloat16)[..., None]
    wg = (wg * scales.astype(jnp.bfloat16)[..., None]).reshape(n, k)
    y = jax.lax.dot_general(x, wg, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * aux[None, :] if kind == "fp4" else y).astype(jnp.bfloat16)


def shape_args(doc: str, argv, ms: str, kind: bool = False,
               only: bool = False) -> tuple[argparse.Namespace, pathlib.Path]:
    """--out DIR (made), --ms, --shapes (and with `kind`, --kind int4|fp4; with `only`, --only REGEX):
    the arguments of the 4-bit benches beside this one (w4_mgpu.py, w4_prefill.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=ms)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    if kind:
        ap.add_argument("--kind", choices=("int4", "fp4"), default="int4")
    if only:
        ap.add_argument("--only", default="", help="a regular expression: the kernel variants to time")
    args = ap.parse_args(argv)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return args, out_dir


def _calibrated(fn, x, ws, target_s):
    """(one jitted executable running fn over every weight copy, calls per timed group of ~target_s,
    its output), after a warm-up call."""
    run = jax.jit(lambda x, ws: [fn(x, *w) for w in ws])
    out = jax.block_until_ready(run(x, ws))
    t0 = time.perf_counter()
    jax.block_until_ready(run(x, ws))
    return run, max(1, min(100, int(target_s / max(time.perf_counter() - t0, 1e-6)))), out


def _time(fn, x, ws, groups=5, target_s=0.02):
    """Seconds per weight copy: one jitted executable runs fn over every copy."""
    run, reps, _ = _calibrated(fn, x, ws, target_s)
    ts = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = run(x, ws)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / (reps * len(ws)))
    return float(np.median(ts)), out[0]


def _time_interleaved(cells: dict, rounds: int = 3, target_s: float = 0.01) -> dict:
    """cells {name: (fn, x, ws)} -> {name: (seconds per weight copy, output on the copies)} or
    {name: Exception} for a cell that does not compile or run. Every cell is jitted and warmed
    first, then timed in `rounds` rounds that visit the cells in turn (clock drift and the
    machine's other noise fall on all of them alike; one cell after another, the same kernel
    twice measured 20-30% apart in session 28), keeping each cell's fastest round."""
    runs, out = {}, {}
    for name, (fn, x, ws) in cells.items():
        try:
            run, reps, y = _calibrated(fn, x, ws, target_s)
            runs[name] = (run, x, ws, reps)
            out[name] = (float("inf"), y[0])
        except Exception as e:  # noqa: BLE001 (reported by the caller)
            out[name] = e
    for _ in range(rounds):
        for name, (run, x, ws, reps) in runs.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                y = run(x, ws)
            jax.block_until_ready(y)
            t = (time.perf_counter() - t0) / (reps * len(ws))
            out[name] = (min(out[name][0], t), out[name][1])
    return out


class _BudgetReached(Exception):
    pass


def main(argv=None):
    global SHAPES, MS, KINDS, SWEEP, MIN_ROTATION_BYTES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=500.0, help="stop starting new cells after this")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode, no torch (plumbing)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {','.join(SHAPES)}")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"some of {','.join(KINDS)}")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="M values")
    ap.add_argument("--only", default="", help="sweep only params with these fields changed from their defaults "
                    "(e.g. 'half2' or 'half2,split_k')")
    ap.add_argument("--min-block-k", type=int, default=0, help="sweep only params with block_k >= this")
    ap.add_argument("--with-tuned", action="store_true",
                    help="also time each cell's current pick (`w4_params_for`): a merged table keeps it where it wins")
    args = ap.parse_args(argv)
    # (session 15's 170 s reached only q/k/v: pick the cells; the table merges into tuned_w4.json)
    SHAPES = {s: SHAPES[s] for s in args.shapes.split(",")}
    KINDS = {k: KINDS[k] for k in args.kinds.split(",")}
    MS = tuple(int(m) for m in args.ms.split(","))
    SWEEP = [p for p in sweep_with(args.only) if p.block_k >= args.min_block_k]
    kernel = skinny_matmul_w4
    if args.cpu_smoke:
        SHAPES, MS, SWEEP, MIN_ROTATION_BYTES = {"a": (256, 96)}, (1, 17), SWEEP[:2] + SWEEP[-1:], 1e4
        kernel = functools.partial(skinny_matmul_w4, interpret=True)
    t_start = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, python=platform.python_version())
    memcpy = 1e12 if args.cpu_smoke else _memcpy()
    meta["memcpy_tb_s"] = memcpy / 1e12
    print(json.dumps(meta), flush=True)
    key = jax.random.key(0)
    rows = []

    def save():
        (out / "w4.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    try:  # (a budget stop still writes the tables below)
        for name, (k, n) in SHAPES.items():
            bf16 = [((jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16),)
                    for i in range(max(2, math.ceil(MIN_ROTATION_BYTES / (n * k * 2))))]
            for kind, group in KINDS.items():
                copies = max(2, math.ceil(MIN_ROTATION_BYTES / (n * k // 2)))
                ws = _weights(jax.random.fold_in(key, n + k), n, k, kind, group, copies)
                ws_native = _xla_native(ws, kind, k, group) if k % group == 0 else None
                packed_bytes = n * ((k + 1) // 2)
                all_bytes = sum(a.nbytes for a in ws[0])
                for m in MS:
                    if time.perf_counter() - t_start > args.budget_s:
                        raise _BudgetReached
                    x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
                    w0 = dequantize_w4_reference(*ws[0], k=k, group_size=group, kind=kind)
                    ref = jnp.dot(x.astype(jnp.float32), w0.T, precision=jax.lax.Precision.HIGHEST)
                    t_bf16, _ = _time(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))), x, bf16)
                    cells = [("xla_bf16", None, t_bf16, None)]
                    t, y = _time(functools.partial(_dequant_dot, k=k, group_size=group, kind=kind), x, ws)
                    cells.append(("xla_dequant_dot", None, t, y))
                    if ws_native is not None:
                        t, y = _time(functools.partial(_xla_native_dot, kind=kind, group_size=group), x, ws_native)
                        cells.append(("xla_native_4bit", None, t, y))
                    tuned = w4_params_for(kind, m, n, k, group) if args.with_tuned else None
                    for p in SWEEP + ([tuned] if tuned is not None and tuned not in SWEEP else []):
                        if p.group_partial and not p.gemv and kind == "fp4" or p.gemv and m > 1:
                            continue
                        try:
                            t, y = _time(functools.partial(kernel, k=k, group_size=group, kind=kind, params=p), x, ws)
                            cells.append(("pallas_w4", p, t, y))
                        except Exception as e:  # noqa: BLE001 - recorded
                            rows.append(dict(shape=name, K=k, N=n, M=m, kind=kind, impl="pallas_w4",
                                             params=p.__dict__, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    for impl, p, t, y in cells:
                        err = None if y is None else float(jnp.linalg.norm(y.astype(jnp.float32) - ref)
                                                            / jnp.linalg.norm(ref))
                        row = dict(shape=name, K=k, N=n, M=m, kind=kind, impl=impl,
                                   params=None if p is None else p.__dict__, time_us=t * 1e6,
                                   packed_tb_s=packed_bytes / t / 1e12, all_tb_s=all_bytes / t / 1e12,
                                   frac_memcpy=packed_bytes / t / memcpy, speedup_vs_bf16=t_bf16 / t, rel_err=err)
                        if impl == "xla_bf16":
                            row.update(packed_tb_s=None, all_tb_s=n * k * 2 / t / 1e12)
                        rows.append(row)
                        print(f"{name:8s} {kind} M={m:2d} {impl:16s} {str(p and p.__dict__):70s} {t * 1e6:8.2f} us "
                              f"x{t_bf16 / t:4.2f} vs bf16" + ("" if err is None else f" err {err:.1e}"), flush=True)
                    save()
    except _BudgetReached:
        print("budget reached", flush=True)
    save()
    md = ["| shape | kind | M | best pallas_w4 (us) | packed TB/s | xla dequant+dot (us) | xla native 4-bit (us) "
          "| bf16 (us) | x bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for name in SHAPES:
        for kind in KINDS:
            for m in MS:
                cell = [r for r in rows if (r["shape"], r["kind"], r["M"]) == (name, kind, m) and "error" not in r]
                best = min((r for r in cell if r["impl"] == "pallas_w4"), key=lambda r: r["time_us"], default=None)
                dq = next((r for r in cell if r["impl"] == "xla_dequant_dot"), None)
                bf = next((r for r in cell if r["impl"] == "xla_bf16"), None)
                nat = next((f"{r['time_us']:.1f}" for r in cell if r["impl"] == "xla_native_4bit"), "-")
                if best and dq and bf:
                    md.append(f"| {name} | {kind} | {m} | {best['time_us']:.1f} | {best['packed_tb_s']:.2f} | "
                              f"{dq['time_us']:.1f} | {nat} | {bf['time_us']:.1f} | {best['speedup_vs_bf16']:.2f} |")
    tuned = {}  # best kernel params per (kind, N, K, M): copy to pallas_kernels/linear/tuned_w4.json
    for r in rows:
        if r.get("impl") == "pallas_w4" and "time_us" in r and (r["rel_err"] or 0) < 1e-2:
            key_ = w4_tuned_key(r["kind"], r["M"], r["N"], r["K"])
            if key_ not in tuned or r["time_us"] < tuned[key_][0]:
                tuned[key_] = (r["time_us"], r["params"])
    (out / "tuned_w4.json").write_text(json.dumps({k_: v[1] for k_, v in sorted(tuned.items())}, indent=1))
    (out / "w4.md").write_text(f"# 4-bit kernel, {meta['device']}, {meta['date']}\n\nmemcpy "
                               f"{meta['memcpy_tb_s']:.2f} TB/s\n\n" + "\n".join(md) + "\n")
    save()


if __name__ == "__main__":
    main()
