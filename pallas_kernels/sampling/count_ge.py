"""The counting pass of the sampler's threshold searches (`metrale_jax.sampling.filter_logits`).

    sums_ge(x f32[R, V], th f32[R, J], weight f32[R, V] | None) -> [R, J]:
        out[r, j] = sum over v of (weight[r, v] or 1) where x[r, v] >= th[r, j]

Each search pass evaluates J = ways - 1 thresholds per row. XLA reduces a row in one thread
block, so a decode batch of 64 rows over a 128,256 vocabulary runs 64 blocks on 132 SMs, and its
passes read 1.3-1.5 TB/s (H200 profile of a batch-64 Llama-3-8B decode step, session 16: 26 us per
counting pass, 45 us per mass pass, 16 passes, ~0.57 ms of a 6.5 ms step). Here a program owns
`block_v` logits of one row (grid rows x ceil(V / block_v): 1,024 programs at 64 rows) and adds
its J partial sums in registers, `sub` columns at a time; XLA then adds the programs' partials
per row ([R, ceil(V / block_v), J], small). Out-of-range columns load as NaN (never >= anything).
Counts are exact; the mass sums add in another order than XLA's (float rounding only).
Lowered through Triton; runs in interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.linear.params import m_bucket


def sums_ge_reference(x, th, weight=None):
    """The same with one comparison tensor [R, J, V] (float32 / int32 sums)."""
    ge = x[:, None, :] >= th[:, :, None]
    if weight is None:
        return jnp.sum(ge, axis=-1, dtype=jnp.int32)
    return jnp.sum(jnp.where(ge, weight[:, None, :], 0.0), axis=-1)


def _kernel(x_ref, th_ref, *refs, v, j, jp, block_v, sub, weighted):
    w_ref, o_ref = refs if weighted else (None, refs[0])
    r = pl.program_id(0)
    c = pl.program_id(1)
    jj = jnp.arange(jp, dtype=jnp.int32)
    th = plgpu_triton.load(th_ref.at[jnp.full((jp,), r, jnp.int32), jj], mask=jj < j,
                           other=jnp.inf)  # f32[Jp] (pads: +inf, never reached)
    dtype = jnp.float32 if weighted else jnp.int32

    def body(i, acc):  # acc [Jp]
        cols = c * block_v + i * sub + jnp.arange(sub, dtype=jnp.int32)
        ok = cols < v
        rows = jnp.full((sub,), r, jnp.int32)
        x = plgpu_triton.load(x_ref.at[rows, cols], mask=ok, other=jnp.nan)  # f32[sub]
        ge = x[None, :] >= th[:, None]  # bool[Jp, sub]
        if weighted:
            w = plgpu_triton.load(w_ref.at[rows, cols], mask=ok, other=0.0)
            return acc + jnp.sum(jnp.where(ge, w[None, :], 0.0), axis=1)
        return acc + jnp.sum(ge.astype(jnp.int32), axis=1)

    acc = jax.lax.fori_loop(0, block_v // sub, body, jnp.zeros((jp,), dtype))
    plgpu_triton.store(o_ref.at[jnp.full((jp,), r, jnp.int32), jnp.full((jp,), c, jnp.int32), jj], acc)


@functools.partial(jax.jit, static_argnames=("block_v", "sub", "interpret"))
def sums_ge(x, th, weight=None, *, block_v: int = 8192, sub: int = 512, interpret: bool = False):
    """out[r, j] = sum of weight[r] (None: the count, i32) over x[r] >= th[r, j] (module doc)."""
    r, v = x.shape
    j = th.shape[1]
    if th.shape[0] != r or (weight is not None and weight.shape != x.shape):
        raise ValueError(f"sums_ge: x {x.shape}, th {th.shape}, weight {None if weight is None else weight.shape}")
    sub = min(sub, m_bucket(v))
    block_v = max(sub, min(block_v, sub * -(-v // sub)))
    block_v -= block_v % sub
    chunks = -(-v // block_v)
    jp = m_bucket(j)  # (the next power of two >= 16: Triton's block sizes)
    weighted = weight is not None
    kernel = functools.partial(_kernel, v=v, j=j, jp=jp, block_v=block_v, sub=sub, weighted=weighted)
    dtype = jnp.float32 if weighted else jnp.int32
    args = (x.astype(jnp.float32), th.astype(jnp.float32)) + ((weight.astype(jnp.float32),) if weighted else ())
    part = pl.pallas_call(
        kernel,
        grid=(r, chunks),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((r, chunks, jp), dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="sums_ge",
    )(*args)
    return jnp.sum(part, axis=1)[:, :j]
